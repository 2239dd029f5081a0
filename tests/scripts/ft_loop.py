"""One replica group of a fault-tolerant run (tests/test_fault_tolerance.py): nd_loop.py's tiny Llama under FSDP in
this group's processes, trained by an Accelerate loop with `Accelerator(fault_tolerance=True)` (the replica id, the
number of groups and the lighthouse come from the environment) until the groups have committed `--steps` optimizer
steps, epoch after epoch, with clipping and a linear schedule.

`--kill R:RANK:STEP:WHERE:RESTART` (repeatable): in its start number RESTART (0: the first), process RANK of
replica group R SIGKILLs itself once committed step STEP is over (WHERE "stepped": its group never joins the next
step's quorum, which the others form without it), after the forward or as the gradients are exchanged of the step
after committed step STEP (WHERE "forward" or "allreduce": the quorum formed with it when its batch was handed out,
so the step fails in every group); its launcher then restarts the group, which heals from a live group.
`--step-seconds`: a pause per step while the quorum is short of a group, so that the live groups outlive a restart
(and run at full speed otherwise). Each process appends one JSON line
per event to `--events` (start, step, kill; a step's: the indices of the group's samples, whether the group took part
and the step was applied); rank 0 writes `--out` at the end (per-group file: the losses of the steps it committed, the
loss of the final weights on a fixed set, the parameters, the committed and discarded steps).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from nd_loop import CLIP, engine_arguments, rows, tiny_model
from torch.utils.data import DataLoader

from hf_backend import Accelerator
from hf_backend.utils import set_seed

PER_PROCESS = 4


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", action="append", default=[], help="REPLICA:RANK:STEP:WHERE:RESTART")
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()

    accelerator = Accelerator(fault_tolerance=True, **engine_arguments("fsdp"))
    replicas = accelerator.replica_groups
    replica, rank, restart = replicas.config.replica_id, accelerator.process_index, accelerator.restart_count

    def event(kind: str, **fields) -> None:
        with open(args.events, "a") as f:
            f.write(json.dumps({"event": kind, "replica": replica, "rank": rank, "restart": restart,
                                "t": time.time(), **fields}) + "\n")

    event("start")
    set_seed(args.seed)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    groups = replicas.config.num_replica_groups
    dataset = [{**row, "index": torch.tensor(i)} for i, row in enumerate(rows(PER_PROCESS * accelerator.num_processes
                                                                              * groups * 10))]
    loader = DataLoader(dataset, batch_size=PER_PROCESS,
                        shuffle=True, generator=torch.Generator().manual_seed(args.seed))  # the seed: the order
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.1, 1 - step / (2 * args.steps)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    kills = {(int(step), where) for r, k, step, where, n in (spec.split(":") for spec in args.kill)
             if (int(r), int(k), int(n)) == (replica, rank, restart)}

    def die_at(where: str) -> None:
        if (replicas.committed_steps, where) in kills:
            event("kill", step=replicas.committed_steps, where=where)
            os.kill(os.getpid(), signal.SIGKILL)

    exchange = replicas.manager.allreduce

    def allreduce(*a, **k):  # the engine's gradient exchange, through torchft's Manager
        if (replicas.committed_steps, "allreduce") in kills:
            replicas.manager.wait_quorum()  # formed with this group: the others exchange with it
            die_at("allreduce")
        return exchange(*a, **k)

    replicas.manager.allreduce = allreduce
    losses, discarded = {}, 0
    while replicas.committed_steps < args.steps:
        for batch in loader:
            step = replicas.committed_steps
            samples = accelerator.gather(batch.pop("index")).tolist()  # the group's (gathered in the group)
            batch["shift_labels"] = batch["labels"]
            loss = model(**batch).loss
            die_at("forward")
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.optimizer_step_was_skipped:
                discarded += 1
            else:
                losses[step] = float(accelerator.reduce(loss.detach(), "mean"))
            event("step", step=replicas.committed_steps, participants=replicas.manager.num_participants(),
                  samples=samples, applied=not accelerator.optimizer_step_was_skipped,
                  participating=replicas.manager.participating_rank() is not None)
            die_at("stepped")
            if replicas.manager.num_participants() < replicas.config.num_replica_groups:
                time.sleep(args.step_seconds)
            if replicas.committed_steps >= args.steps:
                break
    # the final loss on a fixed set (the first 64 sequences, in 4 batches): every process the same batches
    held_out = rows(64)
    with torch.no_grad():
        evaluated = [float(model(**{k: torch.stack([r[k] for r in held_out[i:i + 16]]) for k in held_out[0]},
                                 shift_labels=torch.stack([r["labels"] for r in held_out[i:i + 16]])).loss)
                     for i in range(0, 64, 16)]
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "discarded": discarded, "committed": replicas.committed_steps,
                       "lr": scheduler.get_last_lr(), "epoch": loader.epoch,
                       "final_loss": sum(evaluated) / len(evaluated),
                       "params": {name: t.float().flatten().tolist() for name, t in sorted(state.items())}}, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
