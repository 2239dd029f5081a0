"""The fast unit layer: each strategy's contract checked in this process, in seconds, on a gloo group of one.

No processes are started: a world of one runs the same code as a larger world (DDP's reducer, FSDP2's DTensors,
DeepSpeed's engine) but for the communication. What only several processes show (sharding, gathering, parity with
DDP) is in test_fsdp.py, test_deepspeed.py and test_engine_loops.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from hf_backend.checkpoint import CheckpointIO, manifest
from hf_backend.config.options import GradientAccumulationPlugin, Handlers
from hf_backend.config.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.core.errors import HfBackendError
from hf_backend.state import ProcessState
from hf_backend.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from hf_backend.strategies.capabilities import Joinable, ValueClipping, capability
from hf_backend.training.gradient_state import GradientState
from hf_backend.training.precision import Precision
from hf_backend.training.prepared import PreparedObjects

STRATEGIES = ["single", "ddp", "fsdp_full", "fsdp_sharded", "zero2", "zero3"]


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one in this process, torn down after the module (later tests see no group)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine insists on it
        yield ProcessState(device=torch.device("cpu"), num_processes=1, process_index=0, local_process_index=0,
                           local_num_processes=1, backend="gloo")
    dist.destroy_process_group()


def make_strategy(kind: str, process: ProcessState):
    precision, handlers = Precision("no", process.device, None, None), Handlers()
    if kind == "single":
        return SingleDeviceStrategy(process, precision, handlers)
    if kind == "ddp":
        return DDPStrategy(process, precision, handlers)
    if kind.startswith("fsdp"):
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=16,
            state_dict_type="SHARDED_STATE_DICT" if kind == "fsdp_sharded" else "FULL_STATE_DICT")
        return FSDPStrategy(process, precision, handlers, plugin.resolved())
    pytest.importorskip("deepspeed")
    gradient_state = GradientState(GradientAccumulationPlugin(num_steps=1))
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2}, zero_stage=int(kind[-1]))
    return DeepSpeedStrategy(process, precision, handlers, plugin, gradient_state)


def prepare(strategy, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, PreparedObjects]:
    """What `Accelerator.prepare(model, optimizer)` asks of a strategy."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    (model,), (optimizer,), _ = strategy.setup([model], [optimizer])
    return model, optimizer, PreparedObjects(models=[model], optimizers=[optimizer])


def train_step(strategy, model, optimizer) -> None:
    x, y = torch.arange(8.0).reshape(2, 4) / 8, torch.tensor([0, 1])
    strategy.backward(torch.nn.functional.cross_entropy(model(x), y), 1, True)
    optimizer.step()  # an EngineStepped stand-in (DeepSpeed's engine stepped inside backward) does nothing
    optimizer.zero_grad()


def full_weights(strategy, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().float() for k, v in strategy.model_state_dict(model).items()}


@pytest.mark.parametrize("kind", STRATEGIES)
def test_checkpoint_round_trip(world_of_one, tmp_path, kind):
    strategy = make_strategy(kind, world_of_one)
    model, optimizer, prepared = prepare(strategy, seed=0)
    train_step(strategy, model, optimizer)
    io = CheckpointIO(world_of_one, strategy, strategy.precision, prepared, lambda: {})
    io.write(tmp_path)
    manifest.seal(tmp_path)  # what save() does once every process has written
    saved = full_weights(strategy, model)
    layout = sorted(p.name for p in tmp_path.iterdir())
    expected = {"single": "model.safetensors", "ddp": "model.safetensors", "fsdp_full": "model.safetensors",
                "fsdp_sharded": "model_dcp", "zero2": "model.safetensors", "zero3": "model.safetensors"}[kind]
    assert expected in layout, layout

    other = make_strategy(kind, world_of_one)
    model2, optimizer2, prepared2 = prepare(other, seed=1)
    assert any(not torch.equal(saved[k], v) for k, v in full_weights(other, model2).items())
    CheckpointIO(world_of_one, other, other.precision, prepared2, lambda: {}).read(tmp_path)
    loaded = full_weights(other, model2)
    assert saved.keys() == loaded.keys()
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0)
    # the optimizer continues identically: one more step on each gives the same weights
    train_step(strategy, model, optimizer)
    train_step(other, model2, optimizer2)
    after, after2 = full_weights(strategy, model), full_weights(other, model2)
    for key in after:
        torch.testing.assert_close(after2[key], after[key], rtol=0, atol=0)


@pytest.mark.parametrize("kind", STRATEGIES)
def test_reset_releases_the_model(world_of_one, kind):
    strategy = make_strategy(kind, world_of_one)
    model, optimizer, prepared = prepare(strategy, seed=0)
    train_step(strategy, model, optimizer)
    probe = weakref.ref(strategy.unwrap_model(model))
    prepared.clear()
    strategy.reset()
    del model, optimizer
    gc.collect()
    assert probe() is None, gc.get_referrers(probe())


@pytest.mark.parametrize("kind", STRATEGIES)
def test_what_a_strategy_cannot_do_is_a_capability_it_lacks(world_of_one, kind):
    """join_uneven_inputs and clip_grad_value_ are capabilities a strategy has or lacks, not
    members it overrides only to raise; `capability` refuses in one line naming the strategy and
    the fix."""
    strategy = make_strategy(kind, world_of_one)
    joins, clips = kind in ("single", "ddp"), not kind.startswith("zero")
    assert isinstance(strategy, Joinable) is joins and isinstance(strategy, ValueClipping) is clips
    name = "FSDP" if kind.startswith("fsdp") else "DeepSpeed"
    if not joins:
        with pytest.raises(HfBackendError, match=(
                rf"^join_uneven_inputs is supported with DDP only: under {name} a process that "
                r"runs out of data would hang the others; use even_batches=True \(the default\) "
                r"instead$")):
            capability(strategy, Joinable)
    if not clips:
        with pytest.raises(HfBackendError, match=(
                r"^clip_grad_value_ is not available with DeepSpeed; clip by norm instead "
                r"\(clip_grad_norm_; DeepSpeed: set gradient_clipping in its config\)$")):
            capability(strategy, ValueClipping)


@pytest.mark.parametrize("kind", ["single", "ddp", "fsdp_full"])
def test_full_optimizer_state_is_keyed_by_parameter_names(world_of_one, kind):
    strategy = make_strategy(kind, world_of_one)
    model, optimizer, _ = prepare(strategy, seed=0)
    train_step(strategy, model, optimizer)
    state = strategy.optimizer_state_dict(model, optimizer)
    assert sorted(state["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def fsdp_model(process: ProcessState, **plugin) -> tuple[FSDPStrategy, torch.nn.Module]:
    """Two FSDP blocks (the Linears) under a root without parameters of its own."""
    strategy = FSDPStrategy(process, Precision("no", process.device, None, None), Handlers(),
                            FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=16,
                                                           **plugin).resolved())
    torch.manual_seed(0)
    return strategy, strategy.setup_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                              torch.nn.Linear(8, 2)))


def test_fsdp_keeps_the_last_block_gathered_only_when_a_backward_follows(world_of_one):
    from torch.distributed.tensor import DTensor

    _, model = fsdp_model(world_of_one)
    sharded = lambda: [isinstance(model[i].weight, DTensor) for i in (0, 2)]  # noqa: E731 - gathered: a plain tensor
    loss = model(torch.ones(2, 4)).sum()
    assert sharded() == [True, False]  # backward starts with the last block: it stays gathered
    loss.backward()
    assert sharded() == [True, True]
    with torch.no_grad():
        model(torch.ones(2, 4))
    assert sharded() == [True, True]  # no backward follows an evaluation: nothing is left gathered
    _, shard_grad_op = fsdp_model(world_of_one, sharding_strategy="SHARD_GRAD_OP")
    shard_grad_op(torch.ones(2, 4))
    assert not any(isinstance(shard_grad_op[i].weight, DTensor) for i in (0, 2))


@pytest.mark.parametrize("prefetch", [None, False, True])
def test_fsdp_on_the_cpu_gathers_and_reduces_asynchronously(world_of_one, prefetch):
    from hf_backend.strategies.fsdp_overlap import _OverlappedReduceScatter

    _, model = fsdp_model(world_of_one, **({} if prefetch is None else {"forward_prefetch": prefetch}))
    states = [m._get_fsdp_state() for m in (model[0], model[2])]  # FSDP2 internals: one group per state before 2.13
    groups = [g for s in states for g in getattr(s, "_fsdp_param_groups", None) or [s._fsdp_param_group]]
    assert len(groups) == 2 and all(g.unshard_async_op for g in groups)
    assert all(isinstance(g._reduce_scatter_comm, _OverlappedReduceScatter) for g in groups)
    chain = model[0]._get_fsdp_state()._states_to_forward_prefetch
    assert chain == ([] if prefetch is False else [model[2]._get_fsdp_state()])  # unset: on, on the CPU


def test_overlapped_reduce_scatter_waits_at_once_where_fsdp_reads_its_output():
    from hf_backend.strategies.fsdp_overlap import _InFlight, _OverlappedReduceScatter

    param = torch.nn.Parameter(torch.ones(2))
    comm = _OverlappedReduceScatter([param], _InFlight())
    avg, out = dist.ReduceOp.AVG, torch.empty(1)
    assert not comm._read_at_once(out, avg)
    assert comm._read_at_once(out, dist.ReduceOp.SUM)  # fp16 reductions divide the output afterwards
    assert comm._read_at_once(out.to(torch.bfloat16), avg)  # cast back to the parameter's dtype
    param.grad = torch.zeros(2)  # the new gradient is added to this one
    assert comm._read_at_once(out, avg)
    param.grad = None
    param.register_post_accumulate_grad_hook(lambda p: None)
    assert comm._read_at_once(out, avg)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_fsdp_clip_grad_norm_reduces_the_local_shards(world_of_one, monkeypatch, norm_type):
    strategy, model = fsdp_model(world_of_one)
    model(torch.arange(8.0).reshape(2, 4)).pow(2).sum().backward()
    reference = [torch.nn.Parameter(torch.empty_like(p.grad.to_local())) for p in model.parameters()]
    for r, p in zip(reference, model.parameters()):
        r.grad = p.grad.to_local().clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type)
    assert expected > 1.0  # so the gradients are scaled

    def dtensor_clip(*args, **kwargs):
        raise AssertionError("torch's clip_grad_norm_ over DTensors dispatches per gradient")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dtensor_clip)
    torch.testing.assert_close(strategy.clip_grad_norm_(model.parameters(), 1.0, norm_type), expected)
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad.to_local(), r.grad)
