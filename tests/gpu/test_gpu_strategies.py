"""FSDP2 and DeepSpeed ZeRO-2/3 on one GPU.

What hf_backend claims (docs/fsdp.md, docs/deepspeed.md): FSDP or DeepSpeed asked for in a single process train
unsharded, without them; the first two tests check that on the GPU. torchrun with one process is the same case
(WORLD_SIZE 1 sets up no process group), so "world size 1" through the Accelerator never reaches FSDP2 or DeepSpeed.
The strategies themselves are then exercised as tests/test_strategy_units.py does on CPU, here on an NCCL process
group of one in this process: FSDP2 with a bf16 MixedPrecisionPolicy and with CPU offload next to a GPU, DeepSpeed
ZeRO-2 and ZeRO-3 in bf16, and DeepSpeed's FusedAdam (a CUDA op) built from a config's "optimizer" section. What
only several GPUs show (sharding across ranks, NCCL collectives between processes) is not covered on one GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import bert_rows, tiny_bert
from torch.utils.data import default_collate

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.config.options import GradientAccumulationPlugin, Handlers
from hf_backend.state import ProcessState
from hf_backend.strategies import DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from hf_backend.training.gradient_state import GradientState
from hf_backend.training.optim import EngineStepped
from hf_backend.training.precision import Precision
from hf_backend.utils import DummyOptim

CUDA0 = torch.device("cuda", 0)


def _batch() -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA0) for k, v in default_collate(bert_rows(4)).items()}


def _full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


# -- what the Accelerator does in one process (these run first: no process group exists yet) -------------------------
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_asked_for_in_one_process_trains_unsharded_on_the_gpu(backend):
    plugin = {"fsdp_plugin": FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")} \
        if backend == "fsdp" else {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3)}
    accelerator = Accelerator(mixed_precision="bf16", **plugin)
    assert isinstance(accelerator.strategy, SingleDeviceStrategy)
    assert accelerator.distributed_type.value == "NO"
    model = tiny_bert(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert {p.device for p in model.parameters()} == {CUDA0}
    before = _full(accelerator.get_state_dict(model))
    accelerator.backward(model(**_batch()).loss)
    optimizer.step()
    after = _full(accelerator.get_state_dict(model))
    assert any(not torch.equal(before[k], after[k]) for k in before)


# -- the strategies on an NCCL group of one -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def nccl_of_one():
    """An NCCL process group of one in this process, torn down after the module."""
    assert not dist.is_initialized()
    torch.cuda.set_device(CUDA0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine insists on it
        yield ProcessState(device=CUDA0, num_processes=1, process_index=0, local_process_index=0,
                           local_num_processes=1, backend="nccl")
    dist.destroy_process_group()


def _fsdp(process: ProcessState, **options) -> FSDPStrategy:
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["BertLayer"], **options)
    return FSDPStrategy(process, Precision("no", process.device), Handlers(), plugin.resolved())


def _prepare(strategy, model, optimizer):
    (model,), (optimizer,), _ = strategy.setup([model], [optimizer])
    return model, optimizer


def test_fsdp2_bf16_mixed_precision_policy_on_the_gpu(nccl_of_one):
    from torch.distributed.tensor import DTensor

    strategy = _fsdp(nccl_of_one, mixed_precision_policy={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    model = tiny_bert(dropout=0.0)
    model, optimizer = _prepare(strategy, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.device == CUDA0 and p.dtype == torch.float32 for p in params)
    seen: list[torch.dtype] = []
    handle = model.bert.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    before = _full(strategy.model_state_dict(model))
    out = model(**_batch())
    handle.remove()
    assert seen == [torch.bfloat16]  # computed with bf16 parameters
    strategy.backward(out.loss, 1, True)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params if p.requires_grad)
    norm = strategy.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isfinite(norm)
    optimizer.step()
    after = _full(strategy.model_state_dict(model))
    assert sorted(after) == sorted(before) and all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    strategy.reset()


def test_fsdp2_cpu_ram_efficient_loading_and_sharded_state_read_mapped_on_the_gpu(nccl_of_one,
                                                                                   tmp_path):
    """bf16 weights on the CPU become fp32 master shards on the GPU through cpu_ram_efficient_loading (rank 0 shards
    an empty model and receives its own weights, strategies/fsdp.py), equal to the weights; a DCP save of the shards
    then loads back into them through the mapped reader (checkpoint/mapped_dcp.py: CPU mapping -> GPU shard)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from hf_backend.checkpoint.safe_load import dcp_load

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["BertLayer"], cpu_ram_efficient_loading=True)
    strategy = FSDPStrategy(nccl_of_one, Precision("bf16", CUDA0), Handlers(), plugin.resolved())
    model = tiny_bert(dropout=0.0).to(torch.bfloat16)
    expected = _full(model.state_dict())
    model, _ = _prepare(strategy, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.device == CUDA0 and p.dtype == torch.float32 for p in params)
    got = _full(strategy.model_state_dict(model))
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp_path / "shards"))
    with torch.no_grad():
        for p in params:
            p.zero_()
    state = get_model_state_dict(model)
    dcp_load(state, tmp_path / "shards")
    set_model_state_dict(model, state)
    back = _full(strategy.model_state_dict(model))
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    strategy.reset()


def test_fsdp2_cpu_offload_next_to_a_gpu(nccl_of_one):
    strategy = _fsdp(nccl_of_one, cpu_offload=True)
    model = tiny_bert(dropout=0.0)
    model, optimizer = _prepare(strategy, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}  # parameters live on the host
    before = _full(strategy.model_state_dict(model))
    out = model(**_batch())  # computed on the GPU: FSDP2 copies each block's parameters over for its forward
    assert out.logits.device == CUDA0
    strategy.backward(out.loss, 1, True)
    optimizer.step()  # on the CPU
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
    after = _full(strategy.model_state_dict(model))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    strategy.reset()


def _deepspeed(process: ProcessState, stage: int, config: dict | None = None) -> DeepSpeedStrategy:
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 4, **(config or {})}, zero_stage=stage)
    gradient_state = GradientState(GradientAccumulationPlugin(num_steps=1))
    return DeepSpeedStrategy(process, Precision("bf16", process.device), Handlers(), plugin, gradient_state)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_in_bf16_on_the_gpu(nccl_of_one, stage):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed on this machine")
    strategy = _deepspeed(nccl_of_one, stage)
    model = tiny_bert(dropout=0.0)
    engine, optimizer = _prepare(strategy, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert engine is strategy.engine and engine.bfloat16_enabled() and engine.zero_optimization_stage() == stage
    assert {p.device for p in engine.module.parameters()} == {CUDA0}
    if stage == 3:
        assert all(hasattr(p, "ds_numel") for p in engine.module.parameters())  # partitioned by ZeRO-3
    before = _full(strategy.model_state_dict(engine))
    losses = []
    for _ in range(3):
        loss = engine(**_batch()).loss
        losses.append(loss.item())
        strategy.backward(loss, 1, True)  # the engine steps inside backward
    assert isinstance(optimizer, EngineStepped)
    after = _full(strategy.model_state_dict(engine))
    assert sorted(after) == sorted(before)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert losses[-1] < losses[0]  # the same batch three times: the loss falls
    strategy.reset()


def test_deepspeed_builds_fused_adam_from_the_config_on_the_gpu(nccl_of_one):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed on this machine")
    from deepspeed.ops.op_builder import FusedAdamBuilder

    try:
        FusedAdamBuilder().load()  # compiled on first use (DS_BUILD_OPS=0): needs nvcc
    except Exception as error:  # noqa: BLE001 - any failure to build the op means it cannot be tested here
        pytest.skip(f"DeepSpeed's FusedAdam op does not build on this machine: {error}")
    from deepspeed.ops.adam import FusedAdam

    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    strategy = _deepspeed(nccl_of_one, 2, config)
    model = tiny_bert(dropout=0.0)
    engine, optimizer = _prepare(strategy, model, DummyOptim(model.parameters(), lr=1e-3, weight_decay=0.01))
    assert isinstance(engine.basic_optimizer, FusedAdam)
    assert engine.basic_optimizer.param_groups[0]["lr"] == 1e-3
    before = _full(strategy.model_state_dict(engine))
    strategy.backward(engine(**_batch()).loss, 1, True)
    after = _full(strategy.model_state_dict(engine))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    strategy.reset()
