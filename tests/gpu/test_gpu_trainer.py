"""hf_backend.Trainer on a tiny BERT on a GPU with bf16=True and fp16=True: its engine places the model on cuda,
runs the asked precision (a CUDA GradScaler for fp16) and trains (the loss falls)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import bert_rows, tiny_bert

from hf_backend import Accelerator, Trainer, TrainingArguments


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_trains_a_small_bert_in_mixed_precision(precision, tmp_path):
    model = tiny_bert(dropout=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=5e-3,
                             num_train_epochs=4, logging_steps=1, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=0, **{precision: True})
    trainer = Trainer(model=model, args=args, train_dataset=bert_rows(64))
    result = trainer.train()

    accelerator = trainer.accelerator
    assert isinstance(accelerator, Accelerator)
    assert accelerator.device == torch.device("cuda", 0)
    assert accelerator.mixed_precision == precision
    if precision == "fp16":
        assert isinstance(accelerator.scaler, torch.amp.GradScaler) and accelerator.scaler.is_enabled()
    else:
        assert accelerator.scaler is None
    trained = trainer.model
    assert {p.device.type for p in trained.parameters()} == {"cuda"}
    assert all(p.dtype == torch.float32 for p in trained.parameters())  # autocast, fp32 master weights
    assert result.global_step == 32
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 32 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8  # it learns (label = first token's parity)
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p.detach().cpu(), before[n].cpu())]
    assert len(changed) > len(before) // 2
