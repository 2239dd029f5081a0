"""One process on one device: the base strategy, with fp32 master weights under mixed precision."""

from __future__ import annotations

import contextlib

import torch

from ..core.notes import note
from .base import Strategy
from .capabilities import Joinable, ValueClipping


class SingleDeviceStrategy(Strategy, Joinable, ValueClipping):
    def join(self, joinables: list) -> contextlib.AbstractContextManager:
        note("join_uneven_inputs in a single process: nothing to join")
        return contextlib.nullcontext()

    def setup_model(self, model: torch.nn.Module, device_placement: bool = True,
                    evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().setup_model(model, device_placement)
        if not evaluation_mode:
            # a bf16/fp16-loaded model: fp32 masters under mixed precision
            self.precision.keep_fp32_masters(model)
        return model
