"""Precision you can trust (issue 31, item 5): a model loaded in bf16 and trained with bf16 mixed precision steps fp32
master weights with fp32 optimizer state under every strategy (one note says so, with the bytes it costs), as
DeepSpeed does; with mixed precision "no" it trains as loaded (one note); `hf-backend env` and `hf-backend checkpoint
inspect` show dtypes. docs/precision.md has the measurements before and after.

The loss check. The runs compare a tiny Llama loaded in bf16 with the same weights loaded in fp32 (the bf16 values,
exact in fp32), both trained with bf16 autocast: once the bf16 model's trainable parameters are fp32 masters, the two
runs do the same arithmetic, so their losses agree to fp32 rounding (measured: bitwise). The tolerance, 1e-6
relative, is a few fp32 roundings of a loss near 4.2 (spacing 4.8e-7) and ten times below what training bf16 masters
shows already at the first step (1.2e-5 relative: the norms and the loss then compute in bf16) and later (lr 1e-5
updates vanish in bf16: only 14% of the weights moved in 3 steps, against all of them with fp32 masters).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from helpers import run_script

import hf_backend.core.notes
from hf_backend.checkpoint.inspect import describe, inspect_checkpoint
from hf_backend.cli.main import main
from hf_backend.config.options import Handlers
from hf_backend.config.plugins import FullyShardedDataParallelPlugin
from hf_backend.state import ProcessState
from hf_backend.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from hf_backend.training.precision import Precision

precision_dtypes = pytest.importorskip("precision_dtypes")  # tests/scripts, on pytest's `pythonpath`

TOLERANCE = 1e-6  # relative; see the module docstring


def same_losses(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= TOLERANCE * abs(y) for x, y in zip(a, b))


def check_fp32_masters(run: dict, reference: dict) -> None:
    where = f"{run['strategy']} loaded {run['loaded']}"
    assert run["stepped_params"] == ["float32"], where  # what the optimizer steps
    assert run["stepped_grads"] == ["float32"], where  # the gradients it steps with
    assert run["optimizer_state"] == ["float32"], where  # exp_avg, exp_avg_sq
    assert same_losses(run["losses"], reference["losses"]), (where, run["losses"], reference["losses"])


@pytest.fixture
def notes():
    """The engine's one-line notes, each heard again though an earlier test said the same."""
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    hf_backend.core.notes._said.clear()
    hf_backend.core.notes.logger.addHandler(handler)
    yield heard
    hf_backend.core.notes.logger.removeHandler(handler)


# -- every strategy, trained ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def distributed(tmp_path_factory, checkpoints) -> dict:
    """DDP, FSDP2 and DeepSpeed ZeRO-3 on 2 processes, each with the bf16-loaded model and its fp32 twin."""
    out = tmp_path_factory.mktemp("runs") / "r.json"
    run_script("precision_dtypes.py", [str(out), "--strategies", "ddp,fsdp,zero3", "--save", str(checkpoints)],
               nproc=2)
    return {(run["strategy"], run["loaded"]): run for run in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def one_process(checkpoints) -> dict:
    """In this process, as `python train.py` runs."""
    return {loaded: precision_dtypes.train("single", loaded, "bf16", 3, 1e-5,
                                           str(checkpoints / "single") if loaded == "bf16" else None)
            for loaded in ("bf16", "fp32")}


def test_one_process_steps_fp32_masters_of_a_bf16_model(one_process):
    bf16, fp32 = one_process["bf16"], one_process["fp32"]
    check_fp32_masters(bf16, fp32)
    assert bf16["module_params"] == bf16["module_grads"] == ["float32"]
    assert bf16["weights_changed"] == fp32["weights_changed"] == 1.0  # no update vanished in bf16 rounding
    (note,) = bf16["notes"]
    assert note.startswith("mixed_precision=bf16: 22,688 trainable bf16 parameters upcast to fp32 master weights")
    assert "+45.4 kB per process, +45.4 kB of gradients, +90.8 kB of Adam state" in note
    assert fp32["notes"] == []


def test_fp16_model_with_fp16_mixed_precision_trains_fp32_masters():
    # Before: the GradScaler refused ("Attempting to unscale FP16 gradients"), as under Accelerate and transformers.
    fp16 = precision_dtypes.train("single", "fp16", "fp16", 3, 1e-5, None)
    fp32 = precision_dtypes.train("single", "fp32", "fp16", 3, 1e-5, None)
    assert fp16["stepped_params"] == fp16["optimizer_state"] == ["float32"]
    # bf16 values below fp16's normal range (6e-5) lose bits in the fp16 model: a close match, not the same weights
    assert max(abs(a - b) / b for a, b in zip(fp16["losses"], fp32["losses"])) <= 1e-4


def test_without_mixed_precision_a_bf16_model_trains_in_bf16_and_says_so():
    run = precision_dtypes.train("single", "bf16", "no", 2, 1e-5, None)
    assert run["stepped_params"] == run["optimizer_state"] == run["module_grads"] == ["bfloat16"]
    assert run["notes"] == ["the model's 22,688 trainable parameters are bf16 and mixed_precision is 'no': they train "
                            "in bf16, master weights and optimizer state included (mixed_precision='bf16' keeps fp32 "
                            "masters)"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_step_fp32_masters_of_a_bf16_model(distributed, strategy):
    bf16, fp32 = distributed[strategy, "bf16"], distributed[strategy, "fp32"]
    check_fp32_masters(bf16, fp32)
    assert bf16["weights_changed"] == 1.0 and bf16["state_dict"] == ["float32"]
    (note,) = bf16["notes"]
    assert "upcast to fp32 master weights" in note
    assert ("in all, sharded over the ranks" if strategy == "fsdp" else "per process") in note


def test_deepspeed_keeps_fp32_masters_of_its_own(distributed):
    bf16, fp32 = distributed["zero3", "bf16"], distributed["zero3", "fp32"]
    check_fp32_masters(bf16, fp32)
    assert bf16["module_params"] == fp32["module_params"] == ["bfloat16"]  # the engine's module copy, in bf16
    assert bf16["notes"] == []  # nothing for hf_backend to do: DeepSpeed's bf16 optimizer keeps the masters


def test_the_trainer_with_bf16_steps_fp32_masters_of_a_bf16_model(tmp_path):
    """transformers' own Trainer (on Accelerate 1.15) steps this model's bf16 weights with bf16 AdamW state."""
    from hf_backend import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, per_device_train_batch_size=4,
                             max_steps=2, learning_rate=1e-5, report_to=[], save_strategy="no")
    trainer = Trainer(model=precision_dtypes.tiny_llama("bf16"), args=args, train_dataset=Tokens())
    trainer.create_optimizer()  # before the engine prepares the model, as under DDP
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert {p.dtype for group in inner.param_groups for p in group["params"]} == {torch.float32}
    assert {v.dtype for s in inner.state.values() for k, v in s.items() if k.startswith("exp_avg")} == \
        {torch.float32}


# -- what `checkpoint inspect` and `env` show --------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, model_form", [("single", "full"), ("ddp", "full"), ("fsdp", "sharded"),
                                                  ("zero3", "full")])
def test_inspect_shows_the_saved_dtypes(request, checkpoints, strategy, model_form):
    request.getfixturevalue("one_process" if strategy == "single" else "distributed")  # they save the checkpoints
    report = inspect_checkpoint(checkpoints / strategy)
    assert report["verified"] and report["weights"]["model"]["form"].startswith(model_form)
    assert report["dtypes"]["model"] == {"fp32": {"tensors": 21, "values": 22_688}}
    state = report["dtypes"]["optimizer"]
    assert list(state) == ["fp32"] and state["fp32"]["tensors"] == 63
    assert sorted(state["fp32"]["keys"]) == ["exp_avg", "exp_avg_sq", "step"]
    lines = describe(report)
    assert "model dtypes: fp32 21 tensors (22,688 values)" in lines
    assert any(line.startswith("optimizer state dtypes: fp32 63 tensors (45,") for line in lines)


def test_inspect_shows_a_trainer_checkpoint_trained_in_bf16(tmp_path):
    """transformers' files (model.safetensors, optimizer.pt) of a bf16 model trained without mixed precision; the
    optimizer file is memory-mapped, its values never read."""
    model = precision_dtypes.tiny_llama("bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()
    ckpt = tmp_path / "checkpoint-1"
    model.save_pretrained(ckpt)
    torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    lines = describe(inspect_checkpoint(ckpt))
    assert "model dtypes: bf16 21 tensors (22,688 values)" in lines
    assert "optimizer state dtypes: bf16 42 tensors (45,376 values: exp_avg, exp_avg_sq), fp32 21 tensors (21 " \
           "values: step)" in lines  # the most values first


def test_env_shows_dtypes_and_what_mixed_precision_keeps_in_fp32(tmp_path, monkeypatch, capsys):
    for name in [name for name in os.environ if name.startswith("HF_BACKEND_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_BACKEND_MIXED_PRECISION", "bf16")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "dtypes: torch default fp32; autocast computes in cpu bf16" in out
    assert ("mixed precision: bf16 (HF_BACKEND_MIXED_PRECISION): the optimizer steps fp32 master weights with fp32 "
            "state") in out


# -- the strategies' contract, in this process on a gloo group of one -------------------------------------------------
@pytest.fixture
def world_of_one():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ProcessState(device=torch.device("cpu"), num_processes=1, process_index=0, local_process_index=0,
                       local_num_processes=1, backend="gloo")
    dist.destroy_process_group()


class Tied(torch.nn.Module):
    """An embedding tied to the output layer, a frozen layer, a buffer: loaded in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.block = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.frozen(self.embed(ids))) * self.scale)


def make(kind: str, process: ProcessState, mode: str, policy: dict | None = None):
    precision, handlers = Precision(mode, process.device), Handlers()
    if kind == "fsdp":
        plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP", mixed_precision_policy=policy)
        return FSDPStrategy(process, precision, handlers, plugin.resolved())
    return {"single": SingleDeviceStrategy, "ddp": DDPStrategy}[kind](process, precision, handlers)


@pytest.mark.parametrize("kind", ["single", "ddp", "fsdp"])
def test_the_optimizer_built_before_prepare_steps_the_fp32_masters(world_of_one, kind, notes):
    model = Tied().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before prepare, over the bf16 parameters
    held = [p for group in optimizer.param_groups for p in group["params"]]
    strategy = make(kind, world_of_one, "bf16")
    prepared = strategy.setup_model(model)
    optimizer = strategy.setup_optimizer(optimizer)
    if kind != "fsdp":  # the same Parameter objects (FSDP re-points the optimizer at its shards)
        assert [p for group in optimizer.param_groups for p in group["params"]] == held
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in stepped if p.requires_grad} == {torch.float32}
    assert model.frozen.weight.dtype == torch.bfloat16 and model.scale.dtype == torch.bfloat16  # nothing steps them
    assert model.out.weight is model.embed.weight  # still tied
    strategy.backward(prepared(torch.arange(6).reshape(2, 3)).float().square().mean(), 1, True)
    optimizer.step()
    assert {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim()} == {torch.float32}
    (note,) = notes
    assert note.startswith("mixed_precision=bf16: 52 trainable bf16 parameters upcast")  # 8*4 tied + 4*4 + 4


@pytest.mark.parametrize("kind", ["single", "ddp"])
def test_a_model_only_evaluated_stays_as_loaded(world_of_one, kind, notes):
    model = Tied().to(torch.bfloat16)
    make(kind, world_of_one, "bf16").setup_model(model, evaluation_mode=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and notes == []


def test_an_fsdp_policy_param_dtype_alone_keeps_fp32_shards(world_of_one, notes):
    model = Tied().to(torch.bfloat16)
    strategy = make("fsdp", world_of_one, "no", policy={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    strategy.setup_model(model)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    (note,) = notes
    assert note.startswith("the FSDP mixed_precision_policy (param_dtype=bf16): 52 trainable bf16 parameters")
    assert note.endswith("(the policy without param_dtype would train them in bf16)")
