"""Under torchrun with 2 processes and 2 GPUs: each process prints its backend, device and an all-reduce result."""

import torch

from hf_backend import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0], device=accelerator.device), "sum")
print(f"rank {accelerator.process_index}: {accelerator.process.backend} {accelerator.device} "
      f"{accelerator.distributed_type.value} sum={total.item()}", flush=True)
accelerator.end_training()
