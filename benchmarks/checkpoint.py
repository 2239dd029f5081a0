"""Checkpoint speed (issue 18), side by side in one run, medians of `--repeats`:

1. Training stall per save, sync against async `save_state`: an MLP of ~100 M parameters with AdamW (1.2 GB of
   state, batch 4) trains `--steps` steps, saving every `--every`; the stall per save is (loop time with saves -
   loop time without) / saves, so it counts what an async save costs the steps it overlaps (noisy on a busy
   machine; the loops take turns, each repeat); also how long each save_state call blocked. The last save's wait
   is shown apart.
2. `save_state` / `load_state` against the same tensors (weights and optimizer state) written and read with plain
   safetensors calls (`save_file` / `load_file`): full files (DDP: written by rank 0) and shards (FSDP
   SHARDED_STATE_DICT through DCP; plain: each rank's local shards with `save_file`). Where the time goes: the same
   save without fsync, and without fsync and SHA-256; load_state's manifest check alone. `load_file` maps a file
   lazily, so the plain load copies what it read into the live tensors, as loading a checkpoint does.

    .venv/bin/python benchmarks/checkpoint.py
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/checkpoint.py

The page cache is warm for every variant alike (nothing drops it); `os.sync()` runs before each timed save.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from hf_backend import Accelerator, FullyShardedDataParallelPlugin
from hf_backend.checkpoint import manifest, read_index
from hf_backend.utils import set_seed


def build(accelerator: Accelerator, width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    set_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    step(accelerator, model, optimizer, width)  # AdamW's moments exist
    return model, optimizer


BATCH = 4


def step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    accelerator.backward(model(torch.randn(BATCH, width)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def timed(fn, before=None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fresh(path: Path) -> None:
    """Remove what the previous repeat wrote there and flush dirty pages, outside the timing."""
    for p in (path, path.with_name(path.name + ".incomplete")):
        shutil.rmtree(p, ignore_errors=True)
    os.sync()


# -- 1. stall per save ------------------------------------------------------------------------------------------------
def stall(accelerator, model, optimizer, width, root: Path, steps: int, every: int, repeats: int) -> dict:
    """Per mode: the loop's time and how long each save_state call blocked (modes take turns, each repeat)."""
    waits: list[float] = []

    def loop(mode: str | None, blocked: list) -> float:
        fresh(root / "stall")
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        for i in range(steps):
            step(accelerator, model, optimizer, width)
            if mode and i % every == every - 1:
                target = root / "stall" / f"s{i}"
                blocked.append(timed(lambda t=target: accelerator.save_state(t, async_save=mode == "async")))
        looped = time.perf_counter() - start
        if mode == "async":
            waits.append(timed(accelerator.wait_for_checkpoint))
        return looped

    times: dict[str, list] = {"none": [], "sync": [], "async": []}
    blocked: dict[str, list] = {mode: [] for mode in times}
    for _ in range(repeats):
        for mode in times:
            times[mode].append(loop(None if mode == "none" else mode, blocked[mode]))
    base, saves = statistics.median(times["none"]), steps // every
    return {"step_s": base / steps, "saves": saves, "last_wait_s": statistics.median(waits),
            **{mode: {"loop": (statistics.median(times[mode]) - base) / saves, "call": statistics.median(blocked[mode])}
               for mode in ("sync", "async")}}


# -- 2. throughput against plain safetensors ------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain_tensors(accelerator, model, optimizer, sharded: bool) -> tuple[dict, dict]:
    """The tensors a checkpoint holds, as plain safetensors would be handed them (this rank's part when sharded)."""
    strategy, inner = accelerator.strategy, optimizer.optimizer
    weights = strategy.model_state_dict(model, sharded=sharded) if sharded else strategy.model_state_dict(model)
    optim = strategy.optimizer_state_dict(model, inner, sharded=sharded) if sharded else \
        strategy.optimizer_state_dict(model, inner)
    flat = {f"{name}.{key}": local(v).contiguous() for name, s in optim["state"].items() for key, v in s.items()}
    return {k: local(v).contiguous() for k, v in weights.items()}, flat


class NoHash:
    """The manifest checksum's stand-in for the variant without hashing."""

    def __init__(self, *args) -> None:
        pass

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


VARIANTS = ("plain save", "plain save + fsync", "ours save", "ours save, no fsync", "ours save, no fsync, no hash",
            "plain load + copy", "ours load_state", "ours: manifest check alone")


def throughput(accelerator, model, optimizer, root: Path, sharded: bool, repeats: int) -> dict:
    writes = sharded or accelerator.is_main_process
    weights, optim = plain_tensors(accelerator, model, optimizer, sharded)
    rank = accelerator.process_index
    nbytes = sum(t.numel() * t.element_size() for d in (weights, optim) for t in d.values()) if writes else 0
    files = (root / "plain" / f"model_{rank}.safetensors", root / "plain" / f"optimizer_{rank}.safetensors")

    def plain_save(fsync: bool = False) -> None:
        if writes:
            for tensors, path in zip((weights, optim), files):
                save_file(tensors, path)
                if fsync:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
        accelerator.wait_for_everyone()

    def plain_load() -> None:
        if writes:
            with torch.no_grad():
                for tensors, path in zip((weights, optim), files):
                    for key, value in load_file(path).items():
                        tensors[key].copy_(value)
        accelerator.wait_for_everyone()

    def plain_dir() -> None:
        fresh(root / "plain")
        (root / "plain").mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()

    def ours_dir() -> None:
        fresh(root / "ours")
        accelerator.wait_for_everyone()

    def ours(fsync: bool = True, hashing: bool = True) -> None:
        with contextlib.ExitStack() as stack:
            if not fsync:
                stack.enter_context(mock.patch.object(os, "fsync", lambda fd: None))
            if not hashing:
                stack.enter_context(mock.patch.object(manifest, "new_digest", NoHash))
                stack.enter_context(mock.patch.object(manifest, "file_digest", lambda path, *a: ""))
            accelerator.save_state(root / "ours")

    t: dict[str, list] = {k: [] for k in VARIANTS}
    for _ in range(repeats):
        t["plain save"].append(timed(plain_save, plain_dir))
        t["plain save + fsync"].append(timed(lambda: plain_save(fsync=True), plain_dir))
        t["ours save, no fsync, no hash"].append(timed(lambda: ours(False, False), ours_dir))
        t["ours save, no fsync"].append(timed(lambda: ours(False), ours_dir))
        t["ours save"].append(timed(ours, ours_dir))
        t["plain load + copy"].append(timed(plain_load))
        t["ours load_state"].append(timed(lambda: accelerator.load_state(root / "ours")))
        t["ours: manifest check alone"].append(timed(lambda: read_index(root / "ours", checksums=True)))
    total = torch.tensor(nbytes, dtype=torch.float64)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(total)
    return {"bytes": total.item(), **{k: statistics.median(v) for k, v in t.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3584, help="8 layers of width x width: 103 M parameters")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=None, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    root = Path(args.root or tempfile.mkdtemp(prefix="hf_backend_bench_"))
    if accelerator.num_processes > 1:  # one directory for every process: the main one's
        shared = [str(root)]
        torch.distributed.broadcast_object_list(shared)
        root = Path(shared[0])
    model, optimizer = build(accelerator, args.width, args.layers)
    params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    out = [f"\nMLP {args.layers} x {args.width} ({params / 1e6:.1f} M parameters, AdamW), "
           f"{accelerator.num_processes} process(es), median of {args.repeats}"]
    s = stall(accelerator, model, optimizer, args.width, root, args.steps, args.every, args.repeats)
    out += [f"stall per save (step {s['step_s']:.3f} s, {s['saves']} saves in {args.steps} steps):",
            "| variant | stall per save, from loop times (s) | save_state call (s) | call vs sync |",
            "|---|---|---|---|"]
    out += [f"| {mode} save_state | {s[mode]['loop']:.3f} | {s[mode]['call']:.3f} | "
            f"{s[mode]['call'] / s['sync']['call']:.2f}x |" for mode in ("sync", "async")]
    out.append(f"(async: the last save's wait_for_checkpoint took {s['last_wait_s']:.3f} s)")
    results = {"full": throughput(accelerator, model, optimizer, root, False, args.repeats)}
    accelerator.free_memory(model, optimizer)
    fsdp = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
        state_dict_type="SHARDED_STATE_DICT", transformer_cls_names_to_wrap=["Linear"]))
    if fsdp.checkpoint_io.sharded:  # FSDP in one process trains unsharded and writes full files
        model, optimizer = build(fsdp, args.width, args.layers)
        results["sharded (FSDP, DCP)"] = throughput(fsdp, model, optimizer, root, True, args.repeats)
    out += ["save and load against plain safetensors (weights + optimizer state; vs plain: plain time / ours):",
            "| form | variant | time (s) | GB/s | vs plain |", "|---|---|---|---|---|"]
    for form, r in results.items():
        for name in VARIANTS:
            plain = r["plain load + copy"] if "load" in name or "manifest" in name else r["plain save"]
            out.append(f"| {form} | {name} | {r[name]:.2f} | {r['bytes'] / 1e9 / r[name]:.2f} | "
                       f"{plain / r[name]:.2f}x |")
    if fsdp.is_main_process:
        print("\n".join(out), flush=True)
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    fsdp.end_training()


if __name__ == "__main__":
    main()
