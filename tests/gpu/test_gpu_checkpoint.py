"""Exact save / load on a GPU: weights, optimizer, the fp16 scaler and the CUDA random state come back, so training
continues as if never interrupted."""

from __future__ import annotations

import torch
from helpers import bert_rows, tiny_bert
from torch.utils.data import default_collate

from hf_backend import Accelerator
from hf_backend.checkpoint import layout


def _batch(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in default_collate(bert_rows(4, seed=seed)).items()}


def test_save_state_then_load_state_restores_everything_including_the_cuda_rng(tmp_path):
    accelerator = Accelerator(mixed_precision="fp16")
    model = tiny_bert(dropout=0.1)  # dropout draws from the CUDA generator every step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()

    def step(seed: int) -> None:
        accelerator.backward(model(**_batch(seed)).loss)
        optimizer.step()
        optimizer.zero_grad()

    torch.cuda.manual_seed(7)
    for seed in range(3):
        step(seed)
    checkpoint = accelerator.save_state(tmp_path / "ckpt")
    rng = torch.load(tmp_path / "ckpt" / layout.rng_file(0), weights_only=False)
    assert "cuda" in rng and len(rng["cuda"]) == torch.cuda.device_count()

    saved_weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    saved_scale = accelerator.scaler.get_scale()
    state = torch.cuda.get_rng_state()
    step(3)  # the step the resumed run must repeat exactly (same dropout masks)
    expected_weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    expected_draw = torch.rand(8, device="cuda")
    assert not torch.equal(state, torch.cuda.get_rng_state())

    torch.cuda.manual_seed(12345)  # anything, then back
    step(4)
    accelerator.load_state(checkpoint)
    loaded = accelerator.get_state_dict(model)
    for key, value in saved_weights.items():
        assert torch.equal(loaded[key], value), key
    assert accelerator.scaler.get_scale() == saved_scale
    assert torch.equal(torch.cuda.get_rng_state(), state)

    step(3)
    after = accelerator.get_state_dict(model)
    # Not bitwise: the embedding's backward adds with CUDA atomics (order not fixed). Other dropout masks would move
    # the weights by about the learning rate (1e-3), far beyond this tolerance.
    for key, value in expected_weights.items():
        torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(torch.rand(8, device="cuda"), expected_draw)
