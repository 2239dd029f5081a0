"""Failure soak (issue 46): 2 replica groups x 2 CPU processes on torchft, one SIGKILL every `--kill-every` seconds
for `--minutes`, against the same run without failures.

Each group is `hf-backend launch --fault_tolerance` (group 0's launcher serves the lighthouse; the launcher's replica
group defaults: no hang watch; `--max_restarts` as many as the kills) of this file with `--worker`: a tiny Llama
(2 layers, hidden 32) under FSDP inside the group, AdamW, batches of 4 sequences of 16 tokens per process, trained
through `hf_backend.Accelerator` until the driver writes a stop step. Rank 0 of each group appends one JSON line per
step (committed steps, quorum participants, discarded so far); every process one line when it starts (its pid).

The driver, each `--kill-every` seconds, picks a group and a process at random (`--seed`) and SIGKILLs it, but only
when the last steps of both groups had 2 participants (one live group left is the failure nothing protects; the
wait is counted). A minute before the end it stops killing, then writes the stop step (the newest committed step +
20), which both groups reach and exit on. Reported: committed steps per second over the soak against the run
without failures, the kills and how many the killed group survived (it stepped again after its restart), discarded
steps, steps committed by one group alone (it trains the missing group's part of the batch too: every committed step
trains the whole global batch of 16 sequences), the longest pause between two committed steps, and hangs (a pause
longer than the collective timeout, 60 s, or a group that never finished).

    .venv/bin/python benchmarks/fault_soak.py [--minutes 10] [--kill-every 30] [--baseline-minutes 2] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS, PER_GROUP, HANG = 2, 2, 60.0
CLI = [sys.executable, "-m", "hf_backend.cli.main", "launch", "--cpu", "--num_processes", str(PER_GROUP),
       "--num_cpu_threads_per_process", "1", "--fault_tolerance", "--num_replica_groups", str(GROUPS)]


def _worker(events: Path, stop: Path) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_backend import Accelerator, FullyShardedDataParallelPlugin

    accelerator = Accelerator(fault_tolerance=True, fsdp_plugin=FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))
    replicas, rank = accelerator.replica_groups, accelerator.process_index

    def event(**fields) -> None:
        with open(events, "a") as f:
            f.write(json.dumps({"replica": replicas.config.replica_id, "rank": rank, "t": time.time(), **fields})
                    + "\n")

    event(event="start", pid=os.getpid(), restart=accelerator.restart_count)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         use_cache=False))
    ids = torch.randint(0, 48, (4096, 16), generator=torch.Generator().manual_seed(0))
    loader = DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stop_at = None
    while stop_at is None or replicas.committed_steps < stop_at:
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                event(event="step", step=replicas.committed_steps, participants=replicas.manager.num_participants(),
                      discarded=replicas.discarded)
            if stop_at is None and stop.exists():
                stop_at = int(stop.read_text())
            if stop_at is not None and replicas.committed_steps >= stop_at:
                break
    accelerator.end_training()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read(events: Path) -> list[dict]:
    return [json.loads(line) for line in events.read_text().splitlines() if line.endswith("}")]


def _run(work: Path, minutes: float, kill_every: float | None, seed: int) -> dict:
    """One run of both groups; kills when `kill_every` is given."""
    work.mkdir(parents=True)
    events, stop = work / "events.jsonl", work / "stop"
    events.touch()
    port, kills, waited = _free_port(), [], 0
    restarts = str(int(minutes * 60 / kill_every) + 2 if kill_every else 0)
    where = [["--lighthouse_port", str(port)], ["--lighthouse", f"http://127.0.0.1:{port}"]]
    logs = [open(work / f"group{g}.log", "w") for g in range(GROUPS)]  # noqa: SIM115
    groups = []
    for g in range(GROUPS):
        groups.append(subprocess.Popen([*CLI, "--replica_id", str(g), "--max_restarts", restarts, *where[g],
                                        __file__, "--worker", str(events), str(stop)],
                                       stdout=subprocess.DEVNULL, stderr=logs[g]))
        while g == 0 and "torchft lighthouse at" not in (work / "group0.log").read_text():
            time.sleep(0.1)
    rng = random.Random(seed)
    while not any(e.get("event") == "step" for e in _read(events)):
        time.sleep(0.5)
    start = time.time()
    end, next_kill = start + minutes * 60, start + (kill_every or 0)
    while time.time() < end:
        time.sleep(0.5)
        if not kill_every or time.time() < next_kill or time.time() > end - 60:
            continue
        seen = _read(events)
        last = {g: [e for e in seen if e["event"] == "step" and e["replica"] == g][-1:] for g in range(GROUPS)}
        if not all(last[g] and last[g][0]["participants"] == GROUPS for g in range(GROUPS)):
            waited += 1  # a group is still away: killing now could leave none
            next_kill = time.time() + 2
            continue
        group, rank = rng.randrange(GROUPS), rng.randrange(PER_GROUP)
        pid = [e for e in seen if e["event"] == "start" and (e["replica"], e["rank"]) == (group, rank)][-1]["pid"]
        os.kill(pid, signal.SIGKILL)
        kills.append({"t": time.time(), "group": group, "rank": rank, "step": last[group][0]["step"]})
        next_kill = time.time() + kill_every
    soak_end = time.time()
    stop.write_text(str(max(e["step"] for e in _read(events) if e["event"] == "step") + 20))
    codes = []
    for group in groups:
        try:
            codes.append(group.wait(timeout=300))
        except subprocess.TimeoutExpired:
            group.kill()
            codes.append("hung")
    for log in logs:
        log.close()
    return _summary(_read(events), kills, waited, codes, start, soak_end)


def _summary(seen: list[dict], kills: list[dict], waited: int, codes: list, start: float, end: float) -> dict:
    steps = [e for e in seen if e["event"] == "step"]
    during = [e for e in steps if start <= e["t"] <= end]
    first_commit: dict[int, float] = {}
    for e in steps:  # the time each committed step was first reported, by either group
        first_commit.setdefault(e["step"], e["t"])
    times = sorted(first_commit.values())
    pauses = [b - a for a, b in zip(times, times[1:])]
    survived = sum(any(e["replica"] == k["group"] and e["t"] > k["t"] + 1 for e in steps) for k in kills)
    alone = {e["step"] for e in steps if e["participants"] < GROUPS}
    return {"seconds": round(end - start, 1),
            "committed_steps": max(e["step"] for e in during) - min(e["step"] for e in during),
            "steps_per_second": round((max(e["step"] for e in during) - min(e["step"] for e in during))
                                      / (end - start), 3),
            "kills": len(kills), "survived": survived, "kills_deferred_while_a_group_was_away": waited,
            "discarded_steps": max((e["discarded"] for e in steps if e["replica"] == 0), default=0)
            + max((e["discarded"] for e in steps if e["replica"] == 1), default=0),
            "steps_with_one_group": len(alone), "longest_pause_s": round(max(pauses, default=0.0), 2),
            "hangs": sum(p > HANG for p in pauses) + sum(c == "hung" for c in codes),
            "exit_codes": codes, "kill_log": kills}


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        _worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--kill-every", type=float, default=30)
    p.add_argument("--baseline-minutes", type=float, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = _run(Path(tmp) / "baseline", args.baseline_minutes, None, args.seed)
        soak = _run(Path(tmp) / "soak", args.minutes, args.kill_every, args.seed)
    soak["steps_per_second_vs_no_failures"] = round(soak["steps_per_second"] / baseline["steps_per_second"], 3)
    result = {"command": " ".join(sys.argv), "no_failures": baseline, "soak": soak}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if soak["hangs"] == 0 and soak["exit_codes"] == [0, 0] == baseline["exit_codes"] else 1


if __name__ == "__main__":
    sys.exit(main())
