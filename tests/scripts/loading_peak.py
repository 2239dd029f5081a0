"""Private memory per process while FSDP prepares a pretrained model: a tiny Llama saved in bf16 (`--model`), loaded
with `from_pretrained` in its own dtype (transformers maps the file: no private copy yet), then `prepare` under FSDP
FULL_SHARD with bf16 mixed precision (fp32 master shards) and `cpu_ram_efficient_loading` on or off. The peak of
`RssAnon` during `prepare` (sampled every millisecond by a thread of this script) above what the process held before
it, and the loss of one fixed batch after it. Writes `--out DIR`/rank{R}.json."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from memory_measure import return_freed_memory, write_report


def private_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--efficient", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    return_freed_memory()
    from transformers import LlamaForCausalLM

    from hf_backend import Accelerator, FullyShardedDataParallelPlugin

    fsdp = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                          cpu_ram_efficient_loading=bool(args.efficient))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=fsdp)
    model = LlamaForCausalLM.from_pretrained(args.model)
    full_fp32_bytes = sum(q.numel() for q in model.parameters()) * 4
    largest_fp32_bytes = max(q.numel() for q in model.parameters()) * 4

    held = private_bytes()
    peak, done = [held], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], private_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = accelerator.prepare(model)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], private_bytes())

    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    report = {"peak_bytes": peak[0] - held, "full_fp32_bytes": full_fp32_bytes,
              "largest_fp32_bytes": largest_fp32_bytes, "loss": loss}
    write_report(args.out, accelerator.process_index, report)
    accelerator.end_training()


if __name__ == "__main__":
    main()
