"""The registry of what an Accelerator prepared or registered: what `save_state` writes and
`free_memory` drops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("models", "optimizers", "schedulers", "dataloaders", "custom")


@dataclass
class PreparedObjects:
    """In prepare order. `custom`: the objects given to `register_for_checkpointing`."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom: list[Any] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {kind: len(getattr(self, kind)) for kind in KINDS}

    def with_models(self, models: list[torch.nn.Module]) -> PreparedObjects:
        """The same objects with only `models` of the models (in their order)."""
        return dataclasses.replace(self, models=[m for m in self.models if any(m is k for k in models)])

    def clear(self) -> None:
        """Drop every reference, in place (holders of these lists see them empty)."""
        for kind in KINDS:
            getattr(self, kind).clear()
