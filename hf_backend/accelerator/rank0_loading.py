"""Rank-0 loading, told to transformers, where the user asked for it.

With FSDP's `cpu_ram_efficient_loading` only rank 0 needs the pretrained weights: `prepare` gives
every other rank its shards of rank 0's (strategies/fsdp.py). transformers' `from_pretrained` then
builds the model without loading them on ranks other than local rank 0, and it decides that from
two of Accelerate's environment variables alone (`is_fsdp_enabled`: ACCELERATE_USE_FSDP and
FSDP_CPU_RAM_EFFICIENT_LOADING, read at each call once a process group is initialized).

So the Accelerator built with that option sets them (`tell_transformers`), as Accelerate's own
Accelerator and `accelerate launch` do; building a plugin, the options or a strategy writes no
environment. They stay set for the rest of the process: `from_pretrained` may run at any time after
(before `prepare`, or again in the Trainer's `model_init`), an Accelerator has no end of life at
which to unset them, and processes this one starts inherit them as they would inherit what a
launcher exported. A value already there (a launcher's, the user's) is kept.
"""

from __future__ import annotations

import os

VARIABLES = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


def tell_transformers() -> None:
    """Set both variables to "true" where they are unset."""
    for name in VARIABLES:
        os.environ.setdefault(name, "true")
