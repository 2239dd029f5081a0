"""Rank 1 fails after the first collective while rank 0 waits in the next one: the launch must fail fast."""

import torch

from hf_backend import Accelerator

accelerator = Accelerator()
accelerator.wait_for_everyone()
if accelerator.process_index == 1:
    raise ValueError("boom on rank 1")
accelerator.reduce(torch.ones(1))  # rank 0 blocks here until the launcher stops it
