"""FSDP options that change how a step runs: an FSDP2 mixed-precision policy, and activation checkpointing under
bf16 autocast. Each trains a few steps on 2 ranks; rank 0 writes what it saw."""

import json
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_backend import Accelerator, FullyShardedDataParallelPlugin

CONFIG = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
VARIANTS = {
    "bf16_policy": ("no", FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bf16",
                                                                                 "reduce_dtype": "fp32"})),
    "activation_checkpointing": ("bf16", FullyShardedDataParallelPlugin(activation_checkpointing=True)),
    "plain": ("bf16", FullyShardedDataParallelPlugin()),
    "fp32": ("no", FullyShardedDataParallelPlugin()),  # the reference: the same steps without reduced precision
}
seen = {}
for name, (precision, plugin) in VARIANTS.items():
    accelerator = Accelerator(mixed_precision=precision, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = BertForSequenceClassification(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(4):
        ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids[:, 0] % 2).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    wrapped = [type(m).__name__ for m in model.modules() if "Checkpoint" in type(m).__name__]
    seen[name] = {"losses": losses, "param_dtype": str(next(model.parameters()).dtype), "checkpointed": len(wrapped)}
    accelerator.free_memory()
if accelerator.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
