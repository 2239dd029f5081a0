"""What the test modules share (imported as `helpers`; tests/conftest.py holds the fixtures): running a script in
one process or under torchrun with 2 gloo processes and reading its JSON report, the `hf-backend` command line, the
BERT-shaped loop's arguments, the GLUE recipes' smoke-run data, the Transformers docs' FSDP config file, running
a function as an ordinary user (file permissions that hold for root too), the tiny regression model the Trainer
tests train, and the GPU lane's tiny BERT and its data (tests/gpu)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_processes
from warm_processes import free_port  # noqa: F401 - re-exported: tests pick a port through helpers too

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(script: str | Path, args: list[str], nproc: int = 1, timeout: int = 240,
               env: dict[str, str] | None = None, check: bool = True, torchrun: bool = False
               ) -> subprocess.CompletedProcess:
    """Run tests/scripts/<script> (or a script at a path) in `nproc` processes, forked warm (warm_processes.py;
    torchrun's environment when nproc > 1 or `torchrun`). A timeout fails the test with every process's output, and
    so does a failure when `check`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    try:
        proc = warm_processes.run(SCRIPTS / script, args, nproc=nproc, env=full_env, timeout=timeout,
                                  torchrun=torchrun)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{script} {' '.join(map(str, args))} in {nproc} process(es): killed after {timeout} s\n"
                    f"{hung.stdout[-3000:]}\n{hung.stderr[-6000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(map(str, args))} in {nproc} process(es) exited {proc.returncode}\n"
                    f"{proc.stdout[-3000:]}\n{_failed_ranks_first(proc)}")
    return proc


def _failed_ranks_first(proc: subprocess.CompletedProcess) -> str:
    """The stderr of the ranks that failed by themselves (not stopped by the launcher's SIGKILL) first, then the
    others', so that the rank that started a failure is not cut off by the errors it caused elsewhere."""
    codes = getattr(proc, "returncodes", [proc.returncode])
    errors = getattr(proc, "rank_stderr", [proc.stderr])
    order = sorted(range(len(codes)), key=lambda r: codes[r] in (0, -9))
    return "\n".join(f"[rank {r} exited {codes[r]}]\n{errors[r][-(5000 if i == 0 else 1500):]}"
                     for i, r in enumerate(order))


def run_report(script: str, out: Path, args: list[str], nproc: int = 1, **kw) -> dict:
    run_script(script, ["--out", str(out), *args], nproc=nproc, **kw)
    return json.loads(out.read_text())


# The BERT-shaped loop shared by the FSDP and DeepSpeed tests: 32 optimizer steps with accumulation and clipping.
BERT_LOOP = "bert_loop.py"
BERT_TRAIN = ["--batch-size", "4", "--grad-accum", "2", "--epochs", "2"]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    assert all(math.isfinite(x) for x in [*a, *b]), "a NaN would slip through max()"
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def difference_to_largest(a: list[float], b: list[float]) -> float:
    """The largest difference between `a` and `b`, relative to the largest magnitude in `b`: for parameters, where
    element-wise ratios blow up near zero."""
    a_, b_ = torch.tensor(a), torch.tensor(b)
    assert a_.shape == b_.shape and a_.numel() and bool(torch.isfinite(a_).all() and torch.isfinite(b_).all())
    return float((a_ - b_).abs().max() / b_.abs().max())


# The FSDP example of the Transformers docs (an `accelerate config` file), key for key.
DOCS_FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: true
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# -- the `hf-backend` command line, run as a fresh process with a clean environment ----------------------------------
CLI = [sys.executable, "-m", "hf_backend.cli.main"]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_BACKEND_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        env.pop(name, None)
    return {**env, **extra}


def cli(*args: str, input: str | None = None, timeout: int = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, input=input, timeout=timeout,
                          env=cli_env(**env))


# -- the GLUE recipes' smoke runs (tests/test_recipes.py, tests/test_ray.py) ----------------------------------------
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"  # MRPC's header starts with a byte-order mark
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "he", "said", "it", "was", "not", "good"]


def mrpc_rows(n: int, seed: int) -> str:
    import random

    r = random.Random(seed)
    rows = []
    for i in range(n):
        a = " ".join(r.choice(WORDS) for _ in range(r.randint(4, 10)))
        b = " ".join(r.choice(WORDS) for _ in range(r.randint(4, 10)))
        rows.append(f"{i % 2}\t{1000 + i}\t{2000 + i}\t\"{a}\t{b}\"")  # unbalanced quotes, as in the real files
    return "".join(row + "\n" for row in rows)


def recipe_args(tiny, out: Path) -> list[str]:
    model_dir, data_dir = tiny
    return ["--task", "mrpc", "--model", str(model_dir), "--data_dir", str(data_dir), "--output_dir", str(out),
            "--epochs", "2", "--batch_size", "8", "--max_length", "32", "--logging_steps", "2"]


# -- config files (tests/test_config.py, tests/test_config_fuzz.py) ---------------------------------------------------
_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list, "list[str]": list}




def assert_valid_config(config: Any) -> None:
    """What a config that loaded promises: each value (sections included) of its key's type, among its choices and
    within its minimum and maximum, and the keys that must agree agree."""
    from hf_backend.config.schema import DeepSpeedSection, FsdpSection, LaunchConfig, fields_of

    for model, values in ((LaunchConfig, dataclasses.asdict(config)), (FsdpSection, config.fsdp_config),
                          (DeepSpeedSection, config.deepspeed_config)):
        fields = fields_of(model)
        assert set(values) <= set(fields), f"{model.__name__}: unknown keys {set(values) - set(fields)}"
        for name, value in values.items():
            meta, annotation = fields[name].metadata, str(fields[name].type)
            if value is None:
                assert annotation.endswith("| None"), f"{name}=None"
                continue
            kind = _TYPES[annotation.split(" | ")[0]]
            assert isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), f"{name}={value!r}"
            assert not annotation.startswith("list[str]") or all(isinstance(v, str) for v in value), f"{name}={value!r}"
            assert meta["choices"] is None or value in meta["choices"], f"{name}={value!r}"
            assert meta["minimum"] is None or value >= meta["minimum"], f"{name}={value!r}"
            assert meta.get("maximum") is None or value <= meta["maximum"], f"{name}={value!r}"
    assert config.machine_rank < config.num_machines and config.num_processes % config.num_machines == 0
    assert config.num_machines == 1 or config.main_process_ip
    assert config.main_process_port is None or config.main_process_port <= 65535


# -- file permissions that hold for root too (tests/test_checkpoint_trust.py) -----------------------------------------
CLONE_NEWUSER = 0x10000000


def as_ordinary_user(function: Callable[[], Any]) -> Any:
    """`function()` in a forked child whose file accesses are checked as an ordinary user's, and its result. As root,
    where chmod blocks nothing, the child enters a new user namespace that maps no user: files owned by root are then
    checked against their "other" permission bits (paths it uses must be world-traversable, and modules it needs
    imported beforehand). Skips the test where the system allows no such namespace."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER) != 0:
                result: tuple = ("skip", f"unshare(CLONE_NEWUSER) failed (errno {ctypes.get_errno()})")
            else:
                result = ("ok", function())
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            result = ("error", f"{type(err).__name__}: {err}")
        with os.fdopen(write, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    if status == "skip":
        pytest.skip(f"running as root and {value}: no way to make a file unreadable to this process")
    assert status == "ok", value
    return value


class Regression(torch.nn.Module):
    """One linear layer the Trainer can train: `forward(x, labels)` returns transformers' {"loss", "logits"} (no loss
    without labels); the same weights every time it is built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.linear(x).squeeze(-1)
        return {"loss": None if labels is None else ((out - labels) ** 2).mean(), "logits": out}


def tiny_bert(seed: int = 0, dropout: float = 0.1, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    """BertForSequenceClassification from a config: vocabulary 128, `layers` layers of width `hidden`, 2 labels."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=64, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, num_labels=2)
    return BertForSequenceClassification(config)


def bert_rows(n: int, seq: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` examples (input_ids, attention_mask, labels) on the CPU, the label a function of the tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (n, seq), generator=generator)
    labels = (ids[:, 0] % 2).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]
