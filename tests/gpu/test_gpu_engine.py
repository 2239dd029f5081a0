"""The engine loop in one process on a GPU: placement on cuda:LOCAL_RANK, pinned / non_blocking batches, bf16
autocast, fp16 with a real GradScaler that skips the step of an overflow, and (with two GPUs) the NCCL choice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import bert_rows, tiny_bert
from torch.utils.data import DataLoader, default_collate

from hf_backend import Accelerator, DataLoaderConfiguration

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_the_device_is_the_local_ranks_gpu():
    accelerator = Accelerator()
    assert accelerator.device == torch.device("cuda", 0)  # LOCAL_RANK unset: 0
    assert accelerator.num_processes == 1 and accelerator.process.backend is None  # one process: no group
    model = accelerator.prepare(tiny_bert())
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 0)}


def test_pinned_batches_arrive_on_the_gpu_unchanged():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True))
    assert accelerator.dataloader_config.non_blocking
    rows = bert_rows(8)
    loader = accelerator.prepare(DataLoader(rows, batch_size=4, pin_memory=True, collate_fn=default_collate))
    batches = list(loader)
    assert len(batches) == 2
    for i, batch in enumerate(batches):
        for key, value in batch.items():
            assert value.device == torch.device("cuda", 0), key
            expected = torch.stack([row[key] for row in rows[4 * i:4 * i + 4]])
            assert torch.equal(value.cpu(), expected), key


def test_bf16_autocast_on_cuda():
    accelerator = Accelerator(mixed_precision="bf16")
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen: list[torch.dtype] = []
    query = accelerator.unwrap_model(model).bert.encoder.layer[0].attention.self.query
    handle = query.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    batch = default_collate(bert_rows(4))
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(**batch)
    handle.remove()
    assert seen == [torch.bfloat16]  # the layers compute in bf16 on cuda
    assert out.logits.dtype == torch.float32  # outputs handed back in fp32, as Accelerate's convert_to_fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert torch.isfinite(out.loss)
    accelerator.backward(out.loss)
    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped  # no scaler in bf16
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.grad is not None)
    with accelerator.autocast():
        product = torch.ones(4, 4, device="cuda") @ torch.ones(4, 4, device="cuda")
    assert product.dtype == torch.bfloat16


def test_fp16_scaler_skips_the_step_of_an_overflow():
    accelerator = Accelerator(mixed_precision="fp16")
    scaler = accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x = torch.randn(4, 8, device="cuda")

    def step(inputs: torch.Tensor) -> None:
        loss = model(inputs).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    step(x)  # an ordinary step
    assert not accelerator.optimizer_step_was_skipped
    assert scaler._scale.device.type == "cuda"  # a CUDA scaler (its scale lives on the GPU)

    weights = [p.detach().clone() for p in model.parameters()]
    scale, lr = scaler.get_scale(), optimizer.param_groups[0]["lr"]
    step(x * 1e5)  # beyond fp16's range (65504) under autocast: inf activations, inf/nan gradients
    assert accelerator.optimizer_step_was_skipped
    assert scaler.get_scale() == scale * 0.5  # backoff_factor 0.5
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))  # the step was not taken
    assert optimizer.param_groups[0]["lr"] == lr  # nor the scheduler's

    step(x)  # training goes on
    assert not accelerator.optimizer_step_was_skipped
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == lr * 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per process: fewer than 2 GPUs")
def test_two_processes_choose_nccl_and_their_local_ranks_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPTS / "nccl_ranks.py")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: nccl cuda:0 MULTI_GPU sum=3.0", "rank 1: nccl cuda:1 MULTI_GPU sum=3.0"]
