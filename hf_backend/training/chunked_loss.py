"""A causal LM's cross-entropy that never holds the whole logits (issue 57).

transformers' causal LMs compute `lm_head(hidden)` for every token, upcast those logits to fp32 and take the
cross-entropy: at 4,096 tokens and a 128k vocabulary that is 2 GiB of fp32 logits a sequence, and their gradient,
larger than a small model. Here the hidden states are multiplied by the head's weight a chunk of tokens at a time;
each chunk's token losses are kept and its logits dropped, and the backward computes each chunk's logits again for
its gradients (the head weight's accumulated over the chunks). The arithmetic is transformers' (`ForCausalLMLoss`):
labels shifted by one unless `shift_labels` is given, -100 ignored, the sum divided by `num_items_in_batch` when
given, else the mean over the targets.

`linear_cross_entropy` is the function; `ChunkedLoss` puts it into a model's own training forward, through hooks;
`chunked_loss(model)` is that for a loop (hf_backend.Trainer uses it by default). Where the result would not be
transformers' (a head with a bias, logits scaled or soft-capped, a loss type other than ForCausalLM), `unsupported`
says why and the model is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from ..core.errors import HfBackendError
from .unwrap import extract_model_from_parallel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100
# Tokens per chunk: at most this many fp32 logits (64 MiB) at a time.
CHUNK_ELEMENTS = 1 << 24


def chunk_tokens(vocab_size: int) -> int:
    return max(16, CHUNK_ELEMENTS // max(vocab_size, 1))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets) / divisor, by chunks of tokens; the backward
    recomputes each chunk's logits. `hidden` [N, H], `weight` [V, H], `targets` [N] (IGNORE_INDEX skipped)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: torch.Tensor,
                chunk: int, compute_dtype: torch.dtype) -> torch.Tensor:
        # each token's loss kept, then summed once in float64: the sum's own rounding (a sum of thousands of fp32
        # terms, cross_entropy's in its order) is left out of the difference from the model's loss
        losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(compute_dtype)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows].to(compute_dtype), w).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target = targets[rows]
            kept = target != IGNORE_INDEX
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            losses[rows] = torch.where(kept, lse[rows] - picked, 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse, divisor)
        ctx.chunk, ctx.compute_dtype = chunk, compute_dtype
        return (losses.double().sum() / divisor.double()).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, divisor = ctx.saved_tensors
        dtype = ctx.compute_dtype
        scale = (grad / divisor).float()
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows].to(dtype)
            target = targets[rows]
            kept = target != IGNORE_INDEX
            # d loss / d logits = softmax - one_hot(target), on the kept tokens, times grad / divisor
            dlogits = F.linear(h, w).float().sub_(lse[rows].unsqueeze(1)).exp_()
            dlogits[torch.arange(len(target), device=target.device)[kept], target[kept]] -= 1.0
            dlogits *= (scale * kept).unsqueeze(1)
            dlogits = dlogits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (dlogits.t() @ h).float()
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None,
                         shift_labels: torch.Tensor | None = None,
                         num_items_in_batch: torch.Tensor | int | None = None,
                         chunk: int | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss(hidden @ weight.T, labels, ...) without the logits: `hidden` [..., H] (the
    decoder's last hidden state), `weight` [V, H] (the head's). Under autocast the products are taken in autocast's
    dtype, as the head's would be."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("linear_cross_entropy needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        divisor = (targets != IGNORE_INDEX).sum().float()  # the mean (0 targets: nan, as cross_entropy's)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(flat, weight, targets, divisor, chunk or chunk_tokens(weight.shape[0]),
                                         compute_dtype)


# -- on a transformers model --------------------------------------------------------------------------------------
# config attributes that transform the logits between the head and the loss (Gemma 2 / 3, Cohere, Granite, ...)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside a PEFT model, else the model."""
    base = getattr(model, "get_base_model", None)
    return cast("PreTrainedModel", base() if callable(base) else model)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the chunked loss would not be the model's own loss, or None when it is."""
    lm = causal_lm(model)
    name = type(lm).__name__
    head = getattr(lm, "get_output_embeddings", lambda: None)()
    if getattr(lm, "loss_type", None) != "ForCausalLM" or "_loss_function" in vars(lm):
        return f"{name}'s loss is not transformers' ForCausalLMLoss"
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"{name}'s head is not a linear layer without bias"
    if type(head.weight) is not torch.nn.Parameter:  # a DTensor (tensor parallelism) or a quantized weight
        return f"{name}'s head weight is a {type(head.weight).__name__}"
    config = getattr(lm, "config", None)
    for attribute in _LOGIT_TRANSFORMS:
        if getattr(config, attribute, None) not in (None, 1, 1.0):
            return f"{name} transforms its logits ({attribute}={getattr(config, attribute)})"
    return None


class ChunkedLoss:
    """The chunked loss in a model's own forward, while installed (`installed`, a context).

    A training call given `labels` (and no `logits_to_keep`) is seen by a pre-hook on the causal
    LM, which hands the targets to the head; the head, called by the model's forward on the last hidden state,
    returns `linear_cross_entropy` of it instead of the logits; the model's loss function (its own for every other
    call) hands that loss on, so the model adds what it adds to its loss (a mixture of experts' router loss) as it
    does; a hook after the forward takes the loss out of `logits`, which is None. Every other call (evaluation,
    no labels, `logits_to_keep`) is the model's own. The hooks run inside the wrappers' calls (DDP, FSDP2 on the
    root and blocks, DeepSpeed), where the head's weight is whole, as its own forward would see it."""

    def __init__(self, model: torch.nn.Module, chunk: int | None = None) -> None:
        self.lm = causal_lm(model)
        self.head = self.lm.get_output_embeddings()
        self.chunk = chunk
        # one forward's progress: the targets handed to the head, then whether the head returned the loss (the
        # tensor itself may come back wrapped: DeepSpeed's ZeRO-3 wraps what its modules return)
        self._targets: dict[str, Any] | None = None
        self._returned = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        lm, head = self.lm, self.head
        own_loss = lm.loss_function
        handles = [lm.register_forward_pre_hook(self._arm, with_kwargs=True),
                   lm.register_forward_hook(self._drop_logits)]
        head_forward = head.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            targets, self._targets = self._targets, None
            if targets is None or type(head.weight) is not torch.nn.Parameter:  # a DTensor: tensor parallelism
                return head_forward(hidden)
            self._returned = True
            return linear_cross_entropy(hidden, head.weight, chunk=self.chunk, **targets)

        def loss_function(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return logits if self._returned else own_loss(logits, *args, **kwargs)

        head.forward = forward
        lm.loss_function = loss_function  # transformers' setter: the instance's own loss function
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            del head.forward
            del lm._loss_function
            self._targets, self._returned = None, False

    def _arm(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._targets, self._returned = None, False
        keep = kwargs.get("logits_to_keep", 0)
        if not module.training or args or isinstance(keep, torch.Tensor) or keep != 0:
            return
        if kwargs.get("labels") is None:  # the model computes a loss only then (with shift_labels when given)
            return
        self._targets = {key: kwargs.get(key) for key in ("labels", "shift_labels", "num_items_in_batch")}

    def _drop_logits(self, module: torch.nn.Module, args: tuple, outputs: Any) -> Any:
        returned, self._targets, self._returned = self._returned, None, False
        if not returned:
            return None
        return type(outputs)(**{key: value for key, value in outputs.items() if key != "logits"})


def chunked_loss(model: torch.nn.Module, chunk: int | None = None) -> contextlib.AbstractContextManager:
    """A context in which the (prepared) causal LM's training calls with `labels` compute their loss by chunks,
    never holding the whole logits: `with hf_backend.chunked_loss(model): loss = model(**batch).loss` (the
    outputs' `logits` is None there). Refused in one line for a model whose loss it would not be."""
    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    why = unsupported(inner)
    if why is not None:
        raise HfBackendError(f"chunked_loss: {why}, so its loss by chunks would not be its own; train it "
                             "without chunked_loss")
    return ChunkedLoss(inner, chunk).installed()
