"""Bases quantized by bitsandbytes (QLoRA): which parameters they are, and where they can train.

A 4-bit parameter (`Params4bit`, nf4 / fp4) is packed integer data with its quantization state (absmax,
code map) on the side, frozen under a LoRA adapter. What each strategy does with it:
- one process, DDP, DeepSpeed ZeRO-1/2: as any frozen parameter (no gradient, no optimizer state);
- DeepSpeed ZeRO-3: partitioned with the rest, gathered for each forward (the state stays on the
  parameter object);
- FSDP2: kept whole on every rank (`fully_shard(ignored_params=...)`): a DTensor of the packed bytes
  would lose the quantization state. The adapter, its gradients and its optimizer state are sharded;
- tensor, context, sequence or expert parallelism: refused in one line (not run with a quantized base).
Refused too: 8-bit bases (`Int8Params`: see _EIGHT_BIT) and quantizers other than bitsandbytes (GPTQ,
AWQ, torchao, ...): only bitsandbytes was run.

bitsandbytes' CPU layers repack their 4-bit weights for inference the first time they run in eval mode
without gradients, and training after that silently stops (measured with 0.50.2: the loss stays
constant); a prepared model keeps the training layout (`keep_training_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.errors import HfBackendError

RUN_METHODS = ("bitsandbytes",)
_EIGHT_BIT = ("prepare(): the base was loaded in 8 bits (load_in_8bit); its layers save a scale (SCB) that is no "
              "attribute of theirs, which torch's distributed state-dict API, under every strategy's checkpoints, "
              "cannot name: load it in 4 bits (load_in_4bit=True, bnb_4bit_quant_type='nf4'), docs/llm.md")


def is_quantized(param: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit or 8-bit parameter (asked of its class: bitsandbytes is not imported)."""
    return type(param).__module__.split(".")[0] == "bitsandbytes"


def quantized_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    return {p for p in model.parameters() if is_quantized(p)}


def quant_method(model: torch.nn.Module) -> str | None:
    """transformers' name of the method `model` was loaded with ("bitsandbytes", "gptq", ...), None
    for a model loaded in floating point (a PEFT model answers for its base)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return "bitsandbytes" if any(map(is_quantized, model.parameters())) else None
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "quantized")
    return str(getattr(method, "value", method))


def prepare(models: Sequence[torch.nn.Module], shape: Any = None) -> None:
    """What `prepare` does first with a quantized model: one line where it has not been run (an 8-bit
    base, another quantizer than bitsandbytes, a grid `shape` (the MeshShape; None without a mesh) that
    splits more than the data); else the model keeps bitsandbytes' training layout."""
    for model in models:
        method = quant_method(model)
        if method is None:
            continue
        if method not in RUN_METHODS:
            raise HfBackendError(f"prepare(): the model was loaded quantized with {method}; hf_backend trains "
                                 "bitsandbytes 4-bit bases only (BitsAndBytesConfig(load_in_4bit=True)), docs/llm.md")
        if any(type(p).__name__ == "Int8Params" for p in model.parameters()):
            raise HfBackendError(_EIGHT_BIT)
        sizes = {name: getattr(shape, name, 1) if shape is not None else 1 for name in ("tp", "cp", "sp", "ep")}
        split = [f"{name}={size}" for name, size in sizes.items() if size > 1]
        if split:
            raise HfBackendError(f"prepare(): a bitsandbytes-quantized base under {', '.join(split)} has not been "
                                 "run; train it (QLoRA) with data parallelism alone (DDP, FSDP, DeepSpeed ZeRO), "
                                 "docs/llm.md")
        keep_training_layout(model)


def keep_training_layout(model: torch.nn.Module) -> None:
    """bitsandbytes' CPU 4-bit layers skip their inference repacking (see the module docstring): each
    layer's own switch for it, which bitsandbytes sets from the CPU's features when it builds it."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False  # type: ignore[assignment]  # Module.__setattr__ takes any value
