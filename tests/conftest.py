"""The shared fixtures. What test modules import (run_script, cli, ...) lives in tests/helpers.py, not here."""

from __future__ import annotations

import collections
import hashlib
import os
import sys
from pathlib import Path

import pytest
from helpers import BERT_LOOP, BERT_TRAIN, HEADER, WORDS, mrpc_rows, run_report

# threadpoolctl sets this (setdefault) when this process first imports it, which some test does sooner or later; set
# from the start, so that the warm process server (tests/warm_processes.py, which restarts when a variable read at
# import changes) is not started a second time when it appears.
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
# DeepSpeed compiles its CPU ops (CPU Adam, the shared-memory collectives) on first use into torch's extension cache,
# by default one directory for every virtualenv of this Python version. The build command names the virtualenv's
# paths, so a run from another one (a second clone, .venv-oldest) changed it and ninja rebuilt both ops (about 70 s,
# minutes under load) the next time any of them ran: one cache per virtualenv, set before any process is started.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    / f"py{sys.version_info.major}{sys.version_info.minor}-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]}"))


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test`'s two workers share the 2 cores: each computes on one thread, as the processes the tests start
    # already do (OMP_NUM_THREADS=1: tests/helpers.py, tests/warm_processes.py), so none waits on another's threads.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bert_ddp(tmp_path_factory) -> dict:
    """The DDP run every sharded strategy is compared with (run once per test session)."""
    return run_report(BERT_LOOP, tmp_path_factory.mktemp("bert_ddp") / "r.json", BERT_TRAIN, nproc=2)


@pytest.fixture
def two_fake_processes():
    """This process as rank 0 of 2 on torch's fake process group (collectives do nothing), for building a strategy
    whose constructor lays out a DeviceMesh; the group and any process state set up on it go afterwards."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hf_backend.accelerator.states import forget_accelerator_state
    from hf_backend.state import ProcessState, process_state_is_set_up, reset_process_state

    assert not dist.is_initialized()
    had_state = process_state_is_set_up()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield ProcessState(torch.device("cpu"), 2, 0, 0, 2, "gloo")
    finally:
        dist.destroy_process_group()
        if not had_state:
            reset_process_state()  # what the test set up on the fake group (TrainingArguments do) goes with it
            forget_accelerator_state()


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
    (data_dir / "train.tsv").write_text(HEADER + mrpc_rows(64, 0), encoding="utf-8")
    (data_dir / "dev.tsv").write_text(HEADER + mrpc_rows(21, 1), encoding="utf-8")
    return model_dir, data_dir


# -- seconds per test file, printed at the end of every run (the README's table of the suite comes from it) ------------
_seconds_per_file: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_per_file[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _seconds_per_file:
        return
    terminalreporter.write_sep("=", f"seconds per test file ({sum(_seconds_per_file.values()):.0f} s in all)")
    for path, seconds in _seconds_per_file.most_common():
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
