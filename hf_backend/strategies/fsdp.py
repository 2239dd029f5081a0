"""The native N-D path: parallelisms applied to the model over one DeviceMesh (parallel/dims.py), the
torchtitan way, in one order: tensor parallelism from the model's tp_plan, the sequence split (cp or
sp: sequences.py), expert parallelism from the model's ep_plan (experts.py: each experts module its
own FSDP unit), activation checkpointing, then FSDP2's `fully_shard` over the data-parallel
dimensions, each block of the wrap policy on its own, then the root. Parameters become DTensors;
their state goes through torch's distributed state-dict API whatever the mesh.

The mesh's shape comes from a ParallelismConfig, or from FSDP1-era options: FULL_SHARD /
SHARD_GRAD_OP shard over every process (`reshard_after_forward` True / False), NO_SHARD and
HYBRID_SHARD replicate across a dimension of the mesh. Forward prefetch is an explicit
block-to-block chain. Checkpoints: SHARDED_STATE_DICT writes DCP directories (each rank its shards);
FULL_STATE_DICT gathers full states to rank 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from ..config.fsdp import FsdpOptions
from ..config.options import Handlers
from ..core.dtypes import dtype_of
from ..core.enums import DistributedType
from ..core.errors import HfBackendError
from ..core.notes import note
from ..parallel.dims import DataShard, MeshShape, build_mesh, data_shard, expert_meshes, fsdp_mesh, sequence_mesh
from ..runtime.process import ProcessState
from ..training.precision import Precision
from . import context_parallel, parallelize, quantized, ulysses
from .base import Strategy
from .capabilities import ValueClipping
from .fsdp_overlap import schedule
from .sequences import SequenceSplit
from .tensor_parallel import apply_tensor_parallel, is_tensor_parallel


class FSDPStrategy(Strategy, ValueClipping):
    distributed_type = DistributedType.FSDP

    def __init__(self, process: ProcessState, precision: Precision, handlers: Handlers,
                 options: FsdpOptions, shape: MeshShape | None = None) -> None:
        """`options`: what `config.backend.choose_backend` resolved; `shape`: the process grid a
        ParallelismConfig asked for (else the sharding strategy's)."""
        super().__init__(process, precision, handlers)
        self.options = options
        self.shape = shape or MeshShape.for_fsdp(self.options.sharding_strategy, process.num_processes,
                                                 process.local_num_processes)
        self.mesh = build_mesh(self.shape, process.device.type)
        self.fsdp_mesh = fsdp_mesh(self.mesh, self.shape)
        self._data_shard = data_shard(self.mesh, self.shape)
        self.sequences = _sequence_split(self.mesh, self.shape)
        self.experts = expert_meshes(self.mesh, self.shape) if self.shape.ep > 1 else None
        self.sharded_checkpoints = self.options.state_dict_type != "FULL_STATE_DICT"
        self.receives_rank0_weights = self.options.cpu_ram_efficient_loading
        # id(parameter before sharding) -> sharded one
        self._new_params: dict[int, torch.nn.Parameter] = {}
        if self.options.backward_prefetch != "BACKWARD_PRE":
            note(f"fsdp backward_prefetch={self.options.backward_prefetch}: FSDP2 always "
                 "prefetches the next block in backward (BACKWARD_PRE)")


    # -- wrapping ----------------------------------------------------------------------------------
    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        """The model placed, then the parallelize plan applied (parallelize.py): one step per parallelism."""
        if isinstance(model, FSDPModule):  # sharded by an earlier prepare, or by from_pretrained(distributed_config=)
            self.precision.wrap_forward(model)
            return model
        split_by_transformers = is_tensor_parallel(model, self.mesh["tp"] if self.shape.tp > 1 else None)
        parallelize.check_loadable(model, self.receives_rank0_weights, self.process.is_main_process,
                                   split_by_transformers)
        before = list(model.parameters())  # what an optimizer built before prepare holds; mapped to the shards
        weights = None
        if self.receives_rank0_weights:
            weights, model = parallelize.Rank0Weights.take(model, self.process.is_main_process)
        model = super().setup_model(model, device_placement and weights is None)
        parallelize.apply(model, self.parallelize_plan(model, evaluation_mode, weights, split_by_transformers))
        self._new_params.update({id(old): new for old, new in zip(before, model.parameters())})
        return model

    def parallelize_plan(self, model: torch.nn.Module, evaluation_mode: bool = False,
                         weights: parallelize.Rank0Weights | None = None,
                         split_by_transformers: bool = False) -> list[parallelize.Step]:
        """What this run applies to a placed model, in order."""
        Step = parallelize.Step
        blocks = self._blocks(model)
        # bitsandbytes' packed weights stay whole on every rank (quantized.py)
        kwargs = {**self._shard_kwargs(), "ignored_params": quantized.quantized_parameters(model)}
        on_cpu = self.process.device.type == "cpu" and not self.options.cpu_offload  # offloading: left to FSDP2
        prefetch = on_cpu if self.options.forward_prefetch is None else self.options.forward_prefetch
        experts = self.experts
        plan = [
            Step("fp32 masters", lambda m: self.precision.keep_fp32_masters(
                m, sharded=True, param_dtype=self._mp_policy().param_dtype)) if not evaluation_mode else None,
            Step("rank 0's weights everywhere", parallelize.broadcast_from_rank0)
            if self.options.sync_module_states and weights is None else None,
            Step("tp", lambda m: apply_tensor_parallel(m, self.mesh["tp"]))
            if self.shape.tp > 1 and not split_by_transformers else None,
            Step(self.sequences.kind, self._split_sequences) if self.sequences is not None else None,
            Step("ep", lambda m: parallelize.shard_experts(m, experts, kwargs))
            if experts is not None else None,
            Step("activation checkpointing", lambda m: parallelize.checkpoint_blocks(m, blocks))
            if self.options.activation_checkpointing else None,
            Step("fully_shard", lambda m: parallelize.shard_blocks_then_root(m, blocks, kwargs)),
            Step("rank 0's weights into the shards", lambda m: weights.send(m, self.process.device))
            if weights is not None else None,
            # fully_shard made the model and its blocks FSDPModules
            Step("overlap", lambda m: schedule(cast(FSDPModule, m), cast("list[FSDPModule]", blocks),
                                               reshard_after_forward=self.options.reshard_after_forward,
                                               forward_prefetch=prefetch, on_cpu=on_cpu,
                                               replicated=kwargs["mesh"].ndim > 1)),
        ]
        return [step for step in plan if step is not None]

    def _split_sequences(self, model: torch.nn.Module) -> None:
        if self.shape.sp > 1:
            ulysses.check_heads(model, self.shape.tp, self.shape.sp)
        assert self.sequences is not None  # the plan has this step only with a split
        self.sequences.apply(model)

    @property
    def data_shard(self) -> DataShard:
        return self._data_shard

    def _mp_policy(self) -> MixedPrecisionPolicy:
        policy = self.options.mixed_precision_policy
        if policy is None:
            # autocast (Precision) handles mixed precision, as in the other strategies
            return MixedPrecisionPolicy()
        if isinstance(policy, dict):
            dtypes: dict[str, Any] = {k: dtype_of(v, f"mixed_precision_policy {k}") for k, v in policy.items()}
            return MixedPrecisionPolicy(**dtypes)
        if not isinstance(policy, MixedPrecisionPolicy):
            return MixedPrecisionPolicy(
                param_dtype=dtype_of(getattr(policy, "param_dtype", None), "mixed_precision_policy param_dtype"),
                reduce_dtype=dtype_of(getattr(policy, "reduce_dtype", None), "mixed_precision_policy reduce_dtype"))
        return policy

    def _shard_kwargs(self) -> dict[str, Any]:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.options.cpu_offload \
            else OffloadPolicy()
        return {"mesh": self.fsdp_mesh, "reshard_after_forward": self.options.reshard_after_forward,
                "mp_policy": self._mp_policy(), "offload_policy": offload}

    def _blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules that become their own FSDP unit, in forward order."""
        policy = self.options.auto_wrap_policy
        if policy == "NO_WRAP":
            return []
        if policy == "SIZE_BASED_WRAP":
            return _size_based(model, self.options.min_num_params)
        names = self.options.transformer_cls_names_to_wrap
        wanted = [n.strip() for n in names.split(",") if n.strip()] if names else \
            list(getattr(model, "_no_split_modules", None) or [])
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in wanted if n not in present]
        if missing or not wanted:
            candidates = sorted({type(m).__name__ for m in model.modules()
                                 if isinstance(m, torch.nn.Module) and _is_block_like(m)})
            what = f"{', '.join(missing)} not in the model" if missing else "no layer class given and the model " \
                "has no _no_split_modules"
            raise HfBackendError(f"fsdp transformer_layer_cls_to_wrap: {what}; its block classes "
                                 f"are {', '.join(candidates) or '(none found)'}")
        return [m for m in model.modules() if type(m).__name__ in wanted and m is not model]

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if optimizer.state:
            raise HfBackendError("prepare(): the optimizer has already stepped; create it before "
                                 "training starts and prepare it together with the model")
        for group in optimizer.param_groups:
            group["params"] = [self._new_params.get(id(p), p) for p in group["params"]]
        if any(not isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
            raise HfBackendError("prepare(): the optimizer holds parameters of a model that is not "
                                 "sharded (built before a prepare that free_memory has since "
                                 "forgotten?); create the optimizer from the prepared model's "
                                 "parameters, or prepare model and optimizer in one call")
        return optimizer

    # -- training step -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        if not isinstance(model, FSDPModule):
            yield
            return
        # keep unsharded gradients: no reduce-scatter this micro step
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def context_parallel(self, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                         keep: Sequence[torch.Tensor]) -> Iterator[None]:
        if self.sequences is None:
            yield
            return
        with self.sequences.split(buffers, seq_dims, keep):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm, norm_type)

    def state_plugins(self) -> dict[str, Any]:
        return {"fsdp_plugin": self.options}  # with Accelerate's plugin attribute names

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
        """Each process clamps its own shards: element-wise clipping needs no communication."""
        for p in parameters:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.clamp_(-clip_value, clip_value)

    # -- state -------------------------------------------------------------------------------------
    # Full states are gathered one parameter at a time onto rank 0's CPU (other ranks get empty
    # dicts); loading a full state gives every rank the whole tensors to keep its shard of.
    save_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    load_options = StateDictOptions(full_state_dict=True, strict=False)

    def load_model_state_dict(self, model: torch.nn.Module, state_dict: dict[str, Any], sharded: bool = False) -> Any:
        """A full state is scattered into the shards by torch's state-dict API (the module's own
        `load_state_dict` knows nothing of them)."""
        return set_model_state_dict(model, state_dict, options=StateDictOptions() if sharded else self.load_options)

    def reset(self) -> None:
        self._new_params.clear()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                   across: Sequence[torch.distributed.ProcessGroup] = ()) -> torch.Tensor:
    """Clip gradients that are DTensors on any meshes (FSDP and tensor-parallel shards, `_StridedShard`
    included) or plain tensors, or a mix; returns the total norm, the one a single process computes
    over the full gradients. `across`: groups whose ranks each hold other parameters of the model (the
    pipeline stages), whose norms join this one's.

    Each gradient's local shard contributes its norm^p; the sums are all-reduced over the mesh
    dimensions each group of gradients is sharded on (never over those it is replicated on), then
    added up. One all-reduce of a scalar per distinct sharding, and no DTensor dispatch per
    gradient; the shards are then scaled in place."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise HfBackendError(f"clip_grad_norm_ norm_type={norm_type}: use a positive number or inf")
    if not grads and not across:
        return torch.tensor(0.0)
    by_groups: dict[tuple, dict[torch.dtype, list[torch.Tensor]]] = {}
    layouts: dict[tuple, tuple] = {}  # (mesh, placements) -> its groups, looked up once per call
    for grad in grads:
        if isinstance(grad, DTensor):
            layout = (id(grad.device_mesh), grad.placements)
            if layout not in layouts:
                layouts[layout] = _sharded_over(grad)
            groups, local = layouts[layout], grad.to_local()
        else:
            groups, local = (), grad
        by_dtype = by_groups.setdefault(groups, {})
        by_dtype.setdefault(local.dtype, []).append(local)
    total = torch.zeros((), device=grads[0].device if grads else None, dtype=torch.float32)
    for groups, by_dtype in by_groups.items():
        norms = [n.float() for same in by_dtype.values() for n in torch._foreach_norm(same, norm_type)]
        part = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if norm_type == math.inf:
            for group in groups:
                torch.distributed.all_reduce(part, op=torch.distributed.ReduceOp.MAX, group=group)
            total = torch.maximum(total, part)
        else:
            part = part ** norm_type
            for group in groups:
                torch.distributed.all_reduce(part, group=group)
            total = total + part
    for group in across:
        op = torch.distributed.ReduceOp.MAX if norm_type == math.inf else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(total, op=op, group=group)
    if norm_type != math.inf:
        total = total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for by_dtype in by_groups.values():
        for dtype, same in by_dtype.items():
            torch._foreach_mul_(same, coefficient.to(dtype))
    return total


def _sharded_over(grad: DTensor) -> tuple:
    """The process groups a gradient's shards are spread over (none for a replicated DTensor)."""
    mesh = grad.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
                 if not placement.is_replicate() and mesh.size(dim) > 1)


def _is_block_like(module: torch.nn.Module) -> bool:
    """Repeated containers (what layer lists hold) are the usual wrap targets."""
    return any(isinstance(child, torch.nn.Module) for child in module.children()) and \
        sum(1 for _ in module.parameters()) > 1


def _size_based(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    chosen: list[torch.nn.Module] = []
    taken: set[int] = set()
    for module in reversed(list(model.modules())):  # children before parents
        if module is model:
            continue
        own = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if own >= min_num_params:
            chosen.append(module)
            taken.update(id(p) for p in module.parameters())
    return list(reversed(chosen))


def _sequence_split(mesh: Any, shape: MeshShape) -> SequenceSplit | None:
    """The attention that sees across the slices: ring attention over balanced slices (cp) or
    Ulysses over contiguous ones (sp)."""
    if shape.sequence_slices == 1:
        return None
    if shape.sp > 1:
        return SequenceSplit(sequence_mesh(mesh, shape), "sp", ulysses.attention, ulysses.NAME)
    return SequenceSplit(sequence_mesh(mesh, shape), "cp", context_parallel.attention, context_parallel.NAME,
                         balanced=True)
