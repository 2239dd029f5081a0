"""`hf-backend checkpoint` (issue 18, item 6): inspect says what a checkpoint holds and whether it verifies (exit 0
only then), consolidate turns any checkpoint's weights into a directory `from_pretrained` loads, convert moves a
checkpoint between its full and sharded forms and each loads to the same state."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import cli, run_report
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Accelerator
from hf_backend.checkpoint import manifest
from hf_backend.checkpoint.consolidate import convert
from hf_backend.cli.main import main

DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed_zero2"  # DeepSpeed's own checkpoint (its README.md)
CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> tuple[Path, Path]:
    """A sharded checkpoint of a BERT-shaped model from 2 FSDP processes, and the same weights as `save_model` wrote
    them (gathered by the engine: what consolidate must reproduce from the shards alone)."""
    root = tmp_path_factory.mktemp("fsdp")
    run_report("bert_loop.py", root / "r.json", ["--fsdp", "FULL_SHARD", "--batch-size", "8", "--epochs", "1",
                                                 "--stop-after", "2", "--checkpoint", str(root / "ckpt"),
                                                 "--save-model", str(root / "model")], nproc=2)
    return root / "ckpt", root / "model"


@pytest.fixture
def one(tmp_path) -> Path:
    """A checkpoint of one process (full weights, the manifest)."""
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    accelerator.save_state(tmp_path / "one")
    return tmp_path / "one"


def hfb(*args: str) -> subprocess.CompletedProcess:
    """`hf-backend ARGS` in this process (a fresh process costs seconds of imports; one test runs it as one)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def inspect_json(directory: Path) -> dict:
    done = hfb("checkpoint", "inspect", str(directory), "--json")
    return {"rc": done.returncode, **json.loads(done.stdout)}


def test_inspect_a_one_process_checkpoint(one):
    done = hfb("checkpoint", "inspect", str(one))
    assert done.returncode == 0, done.stderr
    assert "strategy: NO, 1 process(es)" in done.stdout
    assert "model: full (safetensors), 2 tensors, 10 parameters" in done.stdout
    assert "verified: yes, every file matches the manifest's size and checksum" in done.stdout
    report = inspect_json(one)
    assert report["rc"] == 0 and report["verified"] and report["manifest"]
    assert report["files"]["model.safetensors"] == (one / "model.safetensors").stat().st_size
    assert {"optimizer.bin", "rng_state_0.pt", "hf_backend_checkpoint.json"} <= set(report["files"])


def test_inspect_a_sharded_fsdp_checkpoint_of_two_processes(fsdp):
    report = inspect_json(fsdp[0])
    assert report["rc"] == 0, report
    assert (report["strategy"], report["num_processes"], report["kind"]) == ("FSDP", 2, "engine")
    assert report["weights"] == {"model": {"form": "sharded (DCP, model_dcp/)"}}
    assert {"model_dcp/.metadata", "optimizer_dcp/.metadata", "rng_state_1.pt"} <= set(report["files"])
    assert report["verified"] and report["manifest"] and report["unlisted"] == []


def test_a_damaged_checkpoint_is_one_line_and_a_failing_exit(one):
    data = bytearray((one / "optimizer.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (one / "optimizer.bin").write_bytes(bytes(data))
    done = cli("checkpoint", "inspect", str(one))
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr == (f"hf-backend checkpoint: error: inspect: {one / 'optimizer.bin'} does not match its "
                           "checksum (changed since it was written); the checkpoint is damaged, use another one\n")
    report = inspect_json(one)
    assert report["rc"] == 1 and not report["verified"] and "optimizer.bin" in report["problem"]


def test_inspect_refuses_code_in_dcp_metadata(one, tmp_path):
    convert(one, tmp_path / "ckpt", "sharded")

    class Payload:
        def __reduce__(self):
            return open, (str(tmp_path / "marker"), "w")

    (tmp_path / "ckpt" / "optimizer_dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    manifest.seal(tmp_path / "ckpt")  # the manifest checks out: the reader is what refuses
    done = hfb("checkpoint", "inspect", str(tmp_path / "ckpt"))
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1
    assert "optimizer_dcp/.metadata holds a pickled" in done.stderr
    assert not (tmp_path / "marker").exists()


def test_inspect_a_checkpoint_of_format_1(one):
    """An earlier hf_backend's checkpoint is described from its files, and does not verify: one line says why."""
    meta_path = one / "hf_backend_checkpoint.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "format_version": 1}))
    done = hfb("checkpoint", "inspect", str(one))
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1
    assert f"{one} is a format-1 checkpoint (written by an hf_backend before 2026-11-27)" in done.stderr
    report = inspect_json(one)
    assert not report["verified"] and report["format_version"] == 1 and "format-1" in report["problem"]
    assert report["weights"] == {"model": {"form": "full (safetensors)", "tensors": 2, "parameters": 10}}


def state_of(directory: Path) -> dict[str, torch.Tensor]:
    return BertForSequenceClassification.from_pretrained(str(directory)).state_dict()


def test_consolidate_a_sharded_checkpoint_loads_with_from_pretrained(fsdp, tmp_path):
    ckpt, saved = fsdp
    done = hfb("checkpoint", "consolidate", str(ckpt), str(tmp_path / "out"), "--config", str(saved / "config.json"))
    assert done.returncode == 0, done.stderr
    assert "config.json" in done.stdout and "model.safetensors" in done.stdout
    expected, found = state_of(saved), state_of(tmp_path / "out")
    assert expected.keys() == found.keys()
    assert all(torch.equal(expected[k], found[k]) for k in expected)
    small = hfb("checkpoint", "consolidate", str(ckpt), str(tmp_path / "small"), "--config", str(saved),
                "--max-shard-size", "20KB")
    assert small.returncode == 0, small.stderr
    assert (tmp_path / "small" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "small").glob("model-*-of-*.safetensors"))) > 1
    assert all(torch.equal(expected[k], v) for k, v in state_of(tmp_path / "small").items())
    again = hfb("checkpoint", "consolidate", str(ckpt), str(tmp_path / "out"))
    assert again.returncode != 0 and "exists and is not an empty directory" in again.stderr


def test_consolidate_without_a_config_writes_the_weights_and_says_so(one, tmp_path):
    done = hfb("checkpoint", "consolidate", str(one), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "only the weights were written" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_consolidate_a_trainer_checkpoint_takes_its_config(tmp_path):
    """A transformers Trainer checkpoint-N (full weights, config.json, trainer_state.json)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CONFIG))
    ckpt = tmp_path / "checkpoint-4"
    model.save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "epoch": 0.5}))
    report = inspect_json(ckpt)
    assert report["rc"] == 0 and report["kind"] == "trainer" and report["progress"]["global_step"] == 4
    done = hfb("checkpoint", "consolidate", str(ckpt), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state_of(tmp_path / "out").items())


def load_in_one_process(directory: Path) -> tuple[dict, dict]:
    """The checkpoint loaded into the objects bert_loop.py prepared, in one process without FSDP."""
    accelerator = Accelerator(cpu=True)
    model = BertForSequenceClassification(BertConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=16, shuffle=True)  # bert_loop's 2 x 8
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.load_state(directory)
    state = optimizer.state_dict()["state"]
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {(i, k): v.clone() for i, s in state.items() for k, v in s.items()})


def test_convert_round_trip_loads_the_same_state(fsdp, tmp_path):
    ckpt = fsdp[0]
    full, back = tmp_path / "full", tmp_path / "back"
    assert hfb("checkpoint", "convert", str(ckpt), str(full), "--to", "full").returncode == 0
    assert (full / "model.safetensors").is_file() and (full / "optimizer.bin").is_file()
    assert not (full / "model_dcp").exists() and inspect_json(full)["verified"]
    done = hfb("checkpoint", "convert", str(full), str(back), "--to", "sharded")
    assert done.returncode == 0, done.stderr
    assert (back / "model_dcp" / ".metadata").is_file() and not (back / "model.safetensors").exists()
    assert inspect_json(back)["verified"]
    weights, moments = load_in_one_process(ckpt)
    assert moments and all(v.abs().sum() > 0 for (_, k), v in moments.items() if k == "exp_avg_sq")
    for converted in (full, back):
        w, m = load_in_one_process(converted)
        assert w.keys() == weights.keys() and all(torch.equal(weights[k], w[k]) for k in weights)
        assert m.keys() == moments.keys() and all(torch.equal(moments[k], m[k]) for k in moments)


def test_consolidate_a_deepspeed_checkpoint(tmp_path):
    """DeepSpeed's own ZeRO-2 files of two processes (`latest` naming global_step4/, as transformers.Trainer writes
    them under DeepSpeed) -> one model.safetensors of the weights the saving run saw, read without pickle."""
    from safetensors.torch import load_file

    done = hfb("checkpoint", "consolidate", str(DEEPSPEED), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    weights = load_file(tmp_path / "out" / "model.safetensors")
    expected = json.loads((DEEPSPEED / "expected.json").read_text())["weights"]
    assert sorted(weights) == sorted(expected)
    assert all(weights[name].flatten().tolist() == values for name, values in expected.items())
