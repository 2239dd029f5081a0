"""Shared helpers: run a script in one process or under torchrun with 2 gloo processes, and read its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import warm_processes

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(script: str | Path, args: list[str], nproc: int = 1, timeout: int = 240,
               env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/scripts/<script> (or a script at a path) in `nproc` processes, forked warm (warm_processes.py;
    torchrun's environment when nproc > 1). A timeout fails the test with every process's output, and so does a
    failure when `check`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    try:
        proc = warm_processes.run(SCRIPTS / script, args, nproc=nproc, env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{script} {' '.join(map(str, args))} in {nproc} process(es): killed after {timeout} s\n"
                    f"{hung.stdout[-3000:]}\n{hung.stderr[-6000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(map(str, args))} in {nproc} process(es) exited {proc.returncode}\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_report(script: str, out: Path, args: list[str], nproc: int = 1, **kw) -> dict:
    run_script(script, ["--out", str(out), *args], nproc=nproc, **kw)
    return json.loads(out.read_text())


# The BERT-shaped loop shared by the FSDP and DeepSpeed tests: 32 optimizer steps with accumulation and clipping.
BERT_LOOP = "bert_loop.py"
BERT_TRAIN = ["--batch-size", "4", "--grad-accum", "2", "--epochs", "2"]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def bert_ddp(tmp_path_factory) -> dict:
    """The DDP run every sharded strategy is compared with (run once per test session)."""
    return run_report(BERT_LOOP, tmp_path_factory.mktemp("bert_ddp") / "r.json", BERT_TRAIN, nproc=2)


# -- the GLUE recipes' smoke runs (tests/test_recipes.py, tests/test_ray.py) ----------------------------------------
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"  # MRPC's header starts with a byte-order mark
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "he", "said", "it", "was", "not", "good"]


def _mrpc_rows(n: int, seed: int) -> str:
    import random

    r = random.Random(seed)
    rows = []
    for i in range(n):
        a = " ".join(r.choice(WORDS) for _ in range(r.randint(4, 10)))
        b = " ".join(r.choice(WORDS) for _ in range(r.randint(4, 10)))
        rows.append(f"{i % 2}\t{1000 + i}\t{2000 + i}\t\"{a}\t{b}\"")  # unbalanced quotes, as in the real files
    return "".join(row + "\n" for row in rows)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT with a word-level vocabulary (saved like a hub model) and an MRPC-format data folder."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    model_dir, data_dir = root / "model", root / "MRPC"
    model_dir.mkdir()
    (model_dir / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, '"']))
    tokenizer = BertTokenizerFast(vocab_file=str(model_dir / "vocab.txt"))
    tokenizer.save_pretrained(model_dir)
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32,
                                             max_position_embeddings=64)).save_pretrained(model_dir)
    data_dir.mkdir()
    (data_dir / "train.tsv").write_text(HEADER + _mrpc_rows(64, 0), encoding="utf-8")
    (data_dir / "dev.tsv").write_text(HEADER + _mrpc_rows(21, 1), encoding="utf-8")
    return model_dir, data_dir


def recipe_args(tiny, out: Path) -> list[str]:
    model_dir, data_dir = tiny
    return ["--task", "mrpc", "--model", str(model_dir), "--data_dir", str(data_dir), "--output_dir", str(out),
            "--epochs", "2", "--batch_size", "8", "--max_length", "32", "--logging_steps", "2"]
