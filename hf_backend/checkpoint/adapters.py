"""A PEFT model's adapter weights into a prepared (possibly sharded) model.

PEFT saves an adapter under names without the adapter's own name (`...q_proj.lora_A.weight` for the
parameter `...q_proj.lora_A.default.weight`; `modules_to_save` copies under the wrapped module's
name). Rather than re-derive PEFT's renaming rules, the names are matched by asking PEFT itself
which of the model's own state-dict entries it would save under which name. peft is imported only
for a model that PEFT built.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch

from ..core.errors import HfBackendError


def is_peft_model(model: torch.nn.Module) -> bool:
    """A model PEFT built (FSDP2's `fully_shard` swaps in a subclass of its class: the class's bases
    are asked)."""
    return hasattr(model, "peft_config") and any(cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__)


def to_model_names(model: torch.nn.Module, saved: dict[str, torch.Tensor],
                   source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """`saved` (an adapter file's tensors) keyed by the model's state-dict names. Every saved tensor
    must have a place in the model, else one line naming the first that has none."""
    from peft import get_peft_model_state_dict

    own = model.state_dict()  # under FSDP2, this process's shards: nothing is gathered
    name_of = {id(tensor): name for name, tensor in own.items()}
    # the one PEFT writes at the top of the directory (others go to subdirectories)
    adapter = cast(str, model.active_adapter)  # a PeftModel's property: the adapter's name
    exported = get_peft_model_state_dict(model, state_dict=own, adapter_name=adapter)
    names: dict[str, Any] = {saved_name: name_of.get(id(tensor)) for saved_name, tensor in exported.items()}
    unknown = [key for key in saved if names.get(key) is None]
    if unknown:
        raise HfBackendError(f"{source} holds {unknown[0]}, which adapter "
                             f"{adapter!r} of this model has no place for; "
                             "resume with the PEFT configuration that wrote it")
    return {names[key]: tensor for key, tensor in saved.items()}
