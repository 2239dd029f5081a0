"""An engine training loop for restarts under `hf-backend launch` (issue 20): it resumes with
`accelerator.resume_from_checkpoint()` and can SIGKILL itself at planned moments.

One epoch over a fixed data set (a 2-layer MLP, AdamW, a linear LR schedule, dropout off), a checkpoint every
`--every` optimizer steps (automatic naming). Each process appends one JSON line per event to `--events`:
`start` (restart count, world size, the step it resumed from), `step` (each optimizer step, with its time), `kill`
(just before it SIGKILLs itself). `--step-delay` paces the steps (until the file
`--delay-until` names exists). `--kill RESTART:RANK:STEP:WHERE` (repeatable): in the run of that restart count,
that rank SIGKILLs itself after optimizer step STEP (`step`), or inside the save of that step's checkpoint, after
the weights and optimizer are written and before it is sealed (`save`, main process only). Rank 0 writes the final
weights (exact floats and a SHA-256 of their bytes) to `--out`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import psutil
import torch
from torch.utils.data import DataLoader, TensorDataset

from hf_backend import Accelerator, ProjectConfiguration

WIDTH = 32


class Progress:
    """The optimizer-step counter, saved with every checkpoint; `state_dict` is where a `save` kill lands."""

    def __init__(self, kill_in_save: set[int]) -> None:
        self.step = 0
        self.kill_in_save = kill_in_save
        self.emit = lambda **kw: None

    def state_dict(self) -> dict:
        if self.step in self.kill_in_save:  # the weights and optimizer are in the staging directory, unsealed
            self.emit(event="kill", step=self.step, where="save")
            os.kill(os.getpid(), signal.SIGKILL)
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps of the run (one epoch at global batch 16)")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--delay-until", default=None, help="sleep --step-delay after each step only until this file exists")
    p.add_argument("--keep-global-batch", action="store_true")
    p.add_argument("--kill", action="append", default=[])
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, WIDTH, generator=g)
    y = torch.tanh(x @ torch.randn(WIDTH, WIDTH, generator=g))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    planned = args.samples // args.batch_size  # the schedule in one process's batches, as Accelerate scripts size it
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=planned)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=3))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    rank, restart = accelerator.process_index, accelerator.restart_count
    kills = [tuple(k.split(":")) for k in args.kill]
    mine = {int(s): w for r, k, s, w in kills if int(r) == restart and int(k) == rank}
    progress = Progress({s for s, w in mine.items() if w == "save"})
    accelerator.register_for_checkpointing(progress)

    def emit(**fields) -> None:
        with open(args.events, "a") as f:
            f.write(json.dumps({"rank": rank, "restart": restart, "world": accelerator.num_processes,
                                "t": time.time(), **fields}) + "\n")

    progress.emit = emit
    resumed = accelerator.resume_from_checkpoint(keep_global_batch=args.keep_global_batch)
    emit(event="start", resumed=progress.step, checkpoint=resumed, accumulation=accelerator.gradient_accumulation_steps,
         pid=os.getpid(), created=psutil.Process().create_time())  # the process's start: the restart's breakdown
    for xb, yb in loader if progress.step < args.steps else []:  # a restart after the last save has nothing to do
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        progress.step += 1
        emit(event="step", step=progress.step, lr=scheduler.get_last_lr()[0])
        if mine.get(progress.step) == "step":
            emit(event="kill", step=progress.step, where="step")
            os.kill(os.getpid(), signal.SIGKILL)
        if progress.step % args.every == 0:
            accelerator.save_state()
        if not (args.delay_until and os.path.exists(args.delay_until)):
            time.sleep(args.step_delay)
    params = [float(v) for t in accelerator.unwrap_model(model).state_dict().values() for v in t.flatten()]
    digest = hashlib.sha256(b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                     for t in accelerator.unwrap_model(model).state_dict().values())).hexdigest()
    emit(event="done", step=progress.step)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"params": params, "sha256": digest, "steps": progress.step,
                       "world": accelerator.num_processes}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
