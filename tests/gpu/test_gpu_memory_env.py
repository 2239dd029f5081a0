"""`free_memory` hands the GPU memory of a prepared model and optimizer back, `release_memory` empties the CUDA
cache, the peak-memory figure torch reports is read the way benchmarks/gpu_trainer.py reads it, and `hf-backend env`
names the GPU."""

from __future__ import annotations

import gc

import torch
from helpers import bert_rows, cli, tiny_bert
from torch.utils.data import default_collate

from hf_backend import Accelerator
from hf_backend.utils import release_memory


def test_free_memory_returns_the_gpu_memory_of_prepared_objects():
    warm = torch.ones(64, 64, device="cuda", requires_grad=True)
    (warm @ warm).sum().backward()  # cuBLAS's workspace (kept for the process) is allocated before the baseline
    del warm
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    accelerator = Accelerator()
    model = tiny_bert(layers=4, hidden=256)  # about 13 MB of fp32 weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = {k: v.cuda() for k, v in default_collate(bert_rows(8)).items()}
    accelerator.backward(model(**batch).loss)
    optimizer.step()  # weights, gradients and Adam's two moments now live on the GPU
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held = torch.cuda.memory_allocated() - baseline
    assert held >= 3 * weights
    assert torch.cuda.memory_reserved() > 0

    model, optimizer = accelerator.free_memory(model, optimizer)
    del batch
    assert model is None and optimizer is None
    assert accelerator._models == []
    gc.collect()
    assert torch.cuda.memory_allocated() - baseline < weights // 4  # at most small leftovers (the loss' scalars)


def test_release_memory_empties_the_cuda_cache():
    torch.cuda.empty_cache()  # free blocks earlier tests left cached would be returned too, and blur the count
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    reserved = torch.cuda.memory_reserved()
    (block,) = release_memory(block)  # the caller's reference goes only once the call returns: the block is cached
    assert block is None
    assert torch.cuda.memory_reserved() == reserved
    assert release_memory() == []
    assert torch.cuda.memory_reserved() <= reserved - 64 * 2**20  # the cache went back to the driver


def test_peak_memory_figures():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    block = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    assert torch.cuda.max_memory_allocated() - start >= 32 * 2**20
    assert torch.cuda.memory_allocated() == start


def test_hf_backend_env_reports_the_gpu():
    proc = cli("env")
    assert proc.returncode == 0, proc.stderr
    name = torch.cuda.get_device_name(0)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("cuda available:"))
    assert line == f"cuda available: True ({torch.cuda.device_count()} x {name})"
    assert "nccl=True" in proc.stdout
