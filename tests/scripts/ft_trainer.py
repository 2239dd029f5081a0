"""One replica group of a fault-tolerant Trainer run (tests/test_fault_tolerance.py): hf_backend.Trainer on
nd_loop.py's tiny Llama under FSDP, `TrainingArguments(fault_tolerance=True)` (the launcher's settings), `max_steps`
`--steps`, a checkpoint every 10 steps, a log line every step.

`--kill R:RANK:STEP` makes process RANK of replica group R, in its first start, SIGKILL itself at global step STEP
once the quorum has formed with it, as the gradients are exchanged (the step fails in every group). Each process
appends one JSON line per step to `--events` (global step, epoch, the quorum's participants); rank 0 writes `--out`
at the end (the global step, the parameters, and `trainer.evaluate()`'s loss on 24 held-out sequences with the loss
of the same weights on all 24 in one batch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from nd_loop import MODELS, rows, tiny_model
from transformers import TrainerCallback

from hf_backend import Trainer, TrainingArguments


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill", default="")
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()

    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, save_steps=10, report_to=[], use_cpu=True, seed=0, fault_tolerance=True,
        fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": [MODELS["llama"][2]]})
    replica = training.replica_group.replica_id
    trainer = Trainer(model=tiny_model(), args=training, train_dataset=rows(16 * (args.steps + 10)))
    replicas, rank = trainer.accelerator.replica_groups, trainer.accelerator.process_index
    restart = trainer.accelerator.restart_count
    kill = tuple(map(int, args.kill.split(":"))) if args.kill else None
    exchange = replicas.manager.allreduce

    def allreduce(*a, **k):  # the engine's gradient exchange, through torchft's Manager
        if restart == 0 and kill == (replica, rank, trainer.state.global_step):
            replicas.manager.wait_quorum()  # formed with this group: the others exchange with it
            os.kill(os.getpid(), signal.SIGKILL)
        return exchange(*a, **k)

    replicas.manager.allreduce = allreduce

    class Events(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            with open(args.events, "a") as f:
                f.write(json.dumps({"replica": replica, "rank": rank, "restart": restart, "t": time.time(),
                                    "global_step": state.global_step, "epoch": state.epoch,
                                    "participants": replicas.manager.num_participants()}) + "\n")
            if replicas.manager.num_participants() < replicas.config.num_replica_groups:
                time.sleep(args.step_seconds)  # while a group is missing: the live one outlives its restart

    trainer.add_callback(Events())
    trainer.train()
    held_out = rows(24)  # 2 global batches of 16 in the group (8 a process), the second padded: 24 real
    evaluated = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
    with torch.no_grad():  # every process the same batch: all 24
        whole = float(trainer.model_wrapped(**{k: torch.stack([r[k] for r in held_out]) for k in held_out[0]}).loss)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"global_step": trainer.state.global_step, "discarded": replicas.discarded,
                       "logged_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
                       "eval_loss": evaluated, "whole_set_loss": whole,
                       "params": {name: t.float().flatten().tolist() for name, t in sorted(state.items())}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
