"""`hf-backend plan` (hf_backend/plan/memory.py): its arithmetic on meta models, its one-line refusals, and its figures
against the memory real runs take (tests/scripts/memory_measure.py: resident memory per phase, per process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from memory_measure import CONFIG

from hf_backend import HfBackendError
from hf_backend.cli.main import main as cli
from hf_backend.parallel.dims import MeshShape
from hf_backend.plan.memory import build_on_meta, plan_memory

MIB = 2**20


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """The measured model's config, as a model directory (what `hf-backend plan` takes)."""
    directory = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(**CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    return directory


def _linear_model() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))  # 77 + 24 = 101 parameters


def test_each_strategy_places_the_parameters_as_it_does():
    model = _linear_model()
    single = plan_memory(model, "no")
    assert (single.parameter_bytes, single.gradient_bytes, single.optimizer_bytes) == (404, 404, 808)
    ddp = plan_memory(model, "ddp", 2)
    assert (ddp.parameter_bytes, ddp.gradient_bytes, ddp.optimizer_bytes) == (404, 808, 808)  # + DDP's buckets
    fsdp = plan_memory(model, "fsdp", 2)  # dim 0 cut with padding: 4 x 10, 4, 2 x 7, 2 = 60 of 101 elements
    assert (fsdp.parameter_bytes, fsdp.gradient_bytes, fsdp.optimizer_bytes) == (240, 240, 480)
    zero2 = plan_memory(model, "zero2", 2)  # full weights + a 51-element fp32 partition, its gradient and moments
    assert (zero2.parameter_bytes, zero2.gradient_bytes, zero2.optimizer_bytes) == (404 + 204, 204, 408)
    zero3 = plan_memory(model, "zero3", 2)  # 35 + 4 + 11 + 2 of each tensor, the fp32 partition, the kept weights
    assert (zero3.parameter_bytes, zero3.gradient_bytes, zero3.optimizer_bytes) == (4 * 52 + 204 + 404, 204, 408)
    assert plan_memory(model, "fsdp", 1) == plan_memory(model, "no", 1)  # one process trains unsharded


def test_tensor_parallelism_cuts_as_the_engine_does(llama_dir, two_fake_processes):
    """The plan's local sizes under tp 2 equal those torch's parallelize_module gives the engine's own
    apply_tensor_parallel, on a mesh of torch's fake process group (rank 0 of 2), on the meta device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hf_backend.strategies.tensor_parallel import apply_tensor_parallel

    plan = plan_memory(build_on_meta(str(llama_dir)), "fsdp", 2, shape=MeshShape(tp=2))
    model = build_on_meta(str(llama_dir))
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
    local = {id(p): (p.to_local() if isinstance(p, DTensor) else p) for p in model.parameters()}
    assert plan.parameter_bytes == sum(t.numel() * t.element_size() for t in local.values())
    assert plan.parameter_bytes < plan_memory(model, "no").parameter_bytes * 0.6


def test_lora_trains_the_adapter_alone(llama_dir):
    model = build_on_meta(str(llama_dir), lora_rank=8)
    adapter = 4 * 2 * 8 * (512 + 512)  # 4 layers x (q_proj, v_proj) x rank 8 x (A's 512 inputs + B's 512 outputs)
    plan = plan_memory(model, "ddp", 2)
    assert plan.trainable == adapter and plan.parameters == 29_037_056 + adapter
    assert (plan.gradient_bytes, plan.optimizer_bytes) == (2 * 4 * adapter, 2 * 4 * adapter)


@pytest.mark.parametrize("args, message", [
    (("fsdp", 4), {"shape": MeshShape(dp_shard=2, tp=3)}),
    (("ddp", 4), {"shape": MeshShape(dp_shard=2, tp=2)}),
    (("bad", 2), {}),
])
def test_refusals_are_one_line(args, message):
    with pytest.raises(HfBackendError) as err:
        plan_memory(_linear_model(), *args, **message)
    assert "\n" not in str(err.value) and str(err.value).startswith("plan: ")


def test_the_command_prints_a_table_and_json(llama_dir, capsys):
    assert cli(["plan", str(llama_dir), "--strategy", "fsdp", "--num_processes", "4", "--parallelism",
                "dp_shard=2,tp=2", "--mixed_precision", "bf16", "--sequence_length", "1024"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM: 29,037,056 parameters" in out and "(dp_shard 2 x tp 2)" in out and "total" in out
    assert cli(["plan", str(llama_dir / "config.json"), "--strategy", "zero3", "--num_processes", "2", "--lora", "8",
                "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "zero3" and report["trainable"] == 65_536
    assert cli(["plan", str(llama_dir), "--strategy", "fsdp", "--num_processes", "4", "--parallelism",
                "tp=2,x=2"]) == 2
    assert "--parallelism item 'x=2'" in capsys.readouterr().err
    assert cli(["plan", str(llama_dir), "--strategy", "fsdp", "--num_processes", "2", "--lora", "4",
                "--parallelism", "tp=2"]) == 2
    assert "does not take a PEFT adapter" in capsys.readouterr().err


# -- against real runs -----------------------------------------------------------------------------------------------
# (strategy, processes, LoRA rank). What each phase of the run is compared with (memory_measure.py's phases):
#   no / ddp / fsdp:  prepared ~ parameters, backward ~ gradients, step ~ optimizer state
#   zero1 / zero2:    prepared ~ parameters, backward (DeepSpeed steps in it) ~ optimizer state: gradients are gone
#   zero3:            the whole run ~ parameters + gradients + optimizer state (by phase it varies: below)
RUNS = [("no", 1, 0), ("ddp", 2, 0), ("fsdp", 2, 0), ("zero2", 2, 0), ("zero3", 2, 0), ("ddp", 2, 8),
        ("fsdp", 2, 8), ("zero3", 2, 8)]


def _expected(plan, strategy: str) -> dict[str, int]:
    if strategy == "zero3":  # how much of it is there after prepare varies from run to run: the whole only
        return {"total": plan.parameter_bytes + plan.gradient_bytes + plan.optimizer_bytes}
    if strategy.startswith("zero"):
        return {"prepared": plan.parameter_bytes, "backward": plan.optimizer_bytes, "step": 0}
    return {"prepared": plan.parameter_bytes, "backward": plan.gradient_bytes, "step": plan.optimizer_bytes}


@pytest.mark.parametrize("strategy, nproc, lora", RUNS, ids=[f"{s}-{n}proc{'-lora' if r else ''}" for s, n, r in RUNS])
def test_plan_is_within_ten_percent_of_a_real_run(tmp_path, llama_dir, strategy, nproc, lora):
    from helpers import run_script

    run_script("memory_measure.py", ["--strategy", strategy, "--lora", str(lora), "--out", str(tmp_path)],
               nproc=nproc, timeout=300)
    model = build_on_meta(str(llama_dir), lora_rank=lora)
    plan = plan_memory(model, strategy, nproc)
    expected = _expected(plan, strategy)
    for rank in range(nproc):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for phase, planned in expected.items():
            # 10%, or 8 MiB where the figure is small (a LoRA adapter's gradients and state are under 1 MiB: the
            # few MiB the allocator and DeepSpeed keep around a step are then all of the difference)
            assert abs(measured[phase] - planned) <= max(0.1 * planned, 8 * MIB), \
                f"rank {rank} {phase}: measured {measured[phase] / MIB:.1f} MiB, planned {planned / MIB:.1f} MiB"
