"""What context parallelism (cp) and Ulysses sequence parallelism (sp) share: the sequences of each
batch cut into one slice per rank of the group, and the model's attention modules routed to an
attention of hf_backend's own that sees across the slices. They differ in that attention
(context_parallel.py passes keys and values around a ring; ulysses.py trades sequence slices for
head groups with all-to-all) and in the cut: sp's slices are contiguous, cp's balanced (rank r of
P holds chunks r and 2P-1-r of 2P, so that each has as much of the causal triangle to compute).

`SequenceSplit` is the one object per run: `split` is Accelerate's `maybe_context_parallel` (the
buffers cut in place), and `apply` routes a model's attention to it and adds one forward pre-hook
that checks the inputs and gathers, once per forward, what every attention layer needs of the whole
sequences (`Layout`: which keys are real tokens, which packed sequence each token belongs to).

The loss: a model called with `num_items_in_batch` (the Trainer's way) returns this rank's share of
a sum, which the Trainer's scaling makes exact. A model called without it (Accelerate's loop) is
given the count of its sequences' label tokens over the group, and its loss is returned as the mean
over the whole sequences, with each rank's gradient that of its own tokens: exact for any spread of
label tokens over the slices.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import HfBackendError

_NOT_SPLIT = ("call the model inside accelerator.maybe_context_parallel(buffers=[input_ids, shift_labels, "
              "position_ids], buffer_seq_dims=[1, 1, 1]) so that each rank holds its slice of the sequences")
_LABELS = ("labels without shift_labels: each slice would lose the target of its last token; pass "
           "shift_labels (the labels shifted left by one, -100 at the end) and split them with the other buffers")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The whole sequences of one forward (batch, length): `real` says which tokens are not padding,
    `segments` which packed sequence each token belongs to (None: no padding / one sequence per
    row). transformers' masks say the same: packing is read from the position ids only when there
    is no attention mask."""

    real: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.real is None and self.segments is None

    def mask(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(batch or 1, 1, len(queries), len(keys)) bool: causal, real keys, the same packed
        sequence; every token sees itself, so no row is empty (a padding token's output is never
        used)."""
        allowed = queries[:, None] >= keys[None, :]
        allowed = allowed[None, None]
        if self.real is not None:
            allowed = allowed & self.real[:, None, None, keys]
        if self.segments is not None:
            allowed = allowed & (self.segments[:, None, queries, None] == self.segments[:, None, None, keys])
        return allowed | (queries[:, None] == keys[None, :])[None, None]


class SequenceSplit:
    """The ranks of `mesh` (the cp or the sp dimension) each hold one slice of every sequence:
    contiguous, or with `balanced` a head chunk and a tail chunk; `kind` is "cp" or "sp", the
    config's name, for messages."""

    def __init__(self, mesh: DeviceMesh, kind: str, attention: Callable[..., Any], name: str,
                 balanced: bool = False) -> None:
        self.mesh, self.kind, self.attention, self.name, self.balanced = mesh, kind, attention, name, balanced
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.length = 0  # the whole sequences' length in this forward (set by `split`)
        self.active = False  # inside `split`
        self.layout = Layout()
        self.counted = False  # this forward's item count was the group's, given by `_before_forward`

    # -- the batch ---------------------------------------------------------------------------------
    @property
    def chunks(self) -> int:
        """How many equal chunks each sequence is cut into."""
        return 2 * self.size if self.balanced else self.size

    def indices(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """The places in the whole sequence of `rank`'s slice, in the order it holds them."""
        chunk = self.length // self.chunks
        if not self.balanced:
            return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail = self.chunks - 1 - rank
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                          torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])

    def _local(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        parts = whole.chunk(self.chunks, dim=dim)
        if not self.balanced:
            return parts[self.rank]
        return torch.cat([parts[self.rank], parts[self.chunks - 1 - self.rank]], dim=dim)

    @contextlib.contextmanager
    def split(self, buffers: Sequence[torch.Tensor], dims: Sequence[int],
              keep: Sequence[torch.Tensor]) -> Iterator[None]:
        """Each buffer replaced, in place, by this rank's slice along its sequence dimension; those
        not in `keep` get their whole contents back afterwards. A tensor listed twice (the labels and
        the shifted labels of Accelerate's examples are one tensor) is split once."""
        if len(buffers) != len(dims):
            raise HfBackendError(f"maybe_context_parallel: {len(buffers)} buffers but {len(dims)} "
                                 "buffer_seq_dims; give one sequence dimension per buffer")
        unique: dict[int, tuple[torch.Tensor, int]] = {}
        for buffer, dim in zip(buffers, dims):
            if unique.setdefault(id(buffer), (buffer, dim))[1] != dim:
                raise HfBackendError("maybe_context_parallel: one tensor is listed twice with "
                                     "different buffer_seq_dims; list it once")
        saved = []
        for buffer, dim in unique.values():
            length = buffer.shape[dim]
            if length % self.chunks:
                balanced = f" in 2 x {self.size} balanced chunks" if self.balanced else ""
                raise HfBackendError(f"{self._what}: a sequence of {length} tokens does not split over "
                                     f"{self.kind}_size={self.size}{balanced}; pad the batches to a multiple "
                                     f"of {self.chunks} (pad_to_multiple_of)")
            self.length = length
            whole = buffer.clone()
            saved.append((buffer, None if any(buffer is k for k in keep) else whole))
            local = self._local(whole, dim)
            buffer.resize_(local.shape)
            buffer.copy_(local)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for buffer, contents in saved:
                if contents is not None:
                    buffer.resize_(contents.shape)
                    buffer.copy_(contents)

    @property
    def _what(self) -> str:
        return "context parallelism" if self.kind == "cp" else "sequence parallelism"

    # -- the model ---------------------------------------------------------------------------------
    def apply(self, model: torch.nn.Module) -> None:
        """Point the model's attention modules at this split's attention (through a copy of their
        config: the model's own keeps its implementation, which transformers' Trainer checks), and
        hook its forward; one line for a model that cannot be split."""
        from transformers import AttentionInterface

        name = type(model).__name__
        # transformers' attention layers (their attributes are transformers', not nn.Module's)
        modules: list[Any] = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
        if not modules or not all(m.is_causal for m in modules):
            raise HfBackendError(f"{self._what}: {name} has non-causal attention; {self.kind} splits the "
                                 f"sequences of causal LMs only: set {self.kind}_size=1")
        config = modules[0].config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "sliding_window", None) or getattr(text, "use_sliding_window", False):
            raise HfBackendError(f"{self._what}: {name} uses sliding-window attention, which "
                                 f"{self.kind} does not split; set {self.kind}_size=1")
        AttentionInterface.register(self.name, self.attention)  # a name of hf_backend's own
        copies: dict[int, Any] = {}
        for module in modules:
            if id(module.config) not in copies:
                own = copy.copy(module.config)
                own._attn_implementation_internal = self.name
                copies[id(module.config)] = own
            module.config = copies[id(module.config)]
            module.sequence_split = self
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward, with_kwargs=True)

    def _before_forward(self, _: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Check the inputs, gather the layout, and give a loss without an item count the group's."""
        if not self.active:
            raise HfBackendError(f"{self._what}: {_NOT_SPLIT}")
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        if positions is None:
            raise HfBackendError(f"{self._what}: pass position_ids (and split them with the other "
                                 "buffers): each slice's positions are global")
        if mask is not None and mask.dim() != 2:
            raise HfBackendError(f"{self._what}: a {mask.dim()}-D attention_mask is not supported; pass "
                                 "a 2-D padding mask, or none with packed position_ids")
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise HfBackendError(f"{self._what}: {_LABELS}")
        self.layout = self._gather_layout(positions, mask)
        labels = kwargs.get("shift_labels")
        self.counted = labels is not None and kwargs.get("num_items_in_batch") is None
        if labels is not None and self.counted:
            count = labels.ne(-100).sum()
            dist.all_reduce(count, group=self.group)
            kwargs = {**kwargs, "num_items_in_batch": count}
        return args, kwargs

    def _gather_layout(self, positions: torch.Tensor, mask: torch.Tensor | None) -> Layout:
        local = positions.expand(mask.shape[0], -1) if mask is not None else positions
        both = torch.stack([local, mask.to(local.dtype) if mask is not None else torch.ones_like(local)])
        parts = [torch.empty_like(both) for _ in range(self.size)]
        dist.all_gather(parts, both.contiguous(), group=self.group)
        self.length = both.shape[-1] * self.size
        order = torch.cat([self.indices(rank, both.device) for rank in range(self.size)])
        gathered = torch.cat(parts, dim=-1)  # rank after rank: put back in sequence order
        whole = torch.empty_like(gathered)
        whole[..., order] = gathered
        whole_positions, real = whole.unbind(0)
        if mask is not None:
            return Layout(real=None if bool(real.all()) else real.bool())
        starts = torch.diff(whole_positions, prepend=whole_positions[:, :1] - 1, dim=-1) != 1
        return Layout(segments=starts.cumsum(-1)) if bool(starts[:, 1:].any()) else Layout()

    def _after_forward(self, _: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.requires_grad:  # a pipeline stage's (pipeline.py)
            return _Restore.apply(output, self, (self.layout, self.length))
        if not self.counted or getattr(output, "loss", None) is None:
            return output
        share = output.loss  # this rank's tokens' sum over the group's count
        total = share.detach().clone()
        dist.all_reduce(total, group=self.group)
        # the value is the group's mean; the gradient this rank's share, times the group's size,
        # which the gradients' mean over the data-parallel and sequence ranks divides out again
        output.loss = share * self.size + (total - share.detach() * self.size)
        return output


class _Restore(torch.autograd.Function):
    """The identity on a pipeline stage's output whose backward, the first of the stage's, gives the split back
    the layout of this forward: a schedule runs the forwards of several microbatches before their backwards, and
    the attention's backward (and activation checkpointing's recomputed forward) read the split's layout."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, split: SequenceSplit, state: tuple[Layout, int]) -> torch.Tensor:
        ctx.split, ctx.state = split, state
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.split.layout, ctx.split.length = ctx.state
        return grad, None, None
