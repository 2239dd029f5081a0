"""Two processes of one machine check a checkpoint's checksums together (tests/test_manifest.py): after a save_state
(64 KiB pieces, so that its files have many), each rank counts the bytes it hashes in load_state; then a byte of
optimizer.bin is flipped and each rank records what load_state raised. Writes `--out DIR`/rank{R}.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_backend import Accelerator, HfBackendError
from hf_backend.checkpoint import manifest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    manifest.PIECE = 64 * 2**10
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.randn(4, 256)).square().mean())
    optimizer.step()
    acc.save_state(out / "ckpt")

    hashed = [0]
    plain_hash_range = manifest.hash_range

    def counting(path: Path, start: int = 0, length: int | None = None) -> bytes:
        hashed[0] += min(length, path.stat().st_size - start) if length is not None else path.stat().st_size - start
        return plain_hash_range(path, start, length)

    manifest.hash_range = counting
    acc.load_state(out / "ckpt")
    hashed_in_load = hashed[0]
    files = json.loads((out / "ckpt" / "hf_backend_checkpoint.json").read_text())["files"]
    acc.wait_for_everyone()
    if acc.is_main_process:  # damage the last piece of optimizer.bin
        path = out / "ckpt" / "optimizer.bin"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)
    acc.wait_for_everyone()
    try:
        acc.load_state(out / "ckpt")
        error = None
    except HfBackendError as err:
        error = str(err)
    report = {"hashed": hashed_in_load, "total": sum(entry["size"] for entry in files.values()), "error": error}
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(report))
    acc.end_training()


if __name__ == "__main__":
    main()
