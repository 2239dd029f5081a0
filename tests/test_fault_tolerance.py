"""Fault tolerance across replica groups on torchft (issue 46; fault_tolerance/groups.py): 2 replica groups of
2 processes with FSDP inside each, each group its own `hf-backend launch --fault_tolerance`, joined by the torchft
lighthouse group 0's launcher serves (tests/scripts/ft_loop.py). A process of group 1 is SIGKILLed twice (steps and
ranks drawn from a fixed seed): group 0 keeps stepping alone, training group 1's part of every batch too, group 1's
launcher restarts it, it heals from group 0 (no checkpoint exists to read) and the groups end with bitwise equal
weights after as many optimizer steps as an uninterrupted run, and near its loss. The Trainer's run
(tests/scripts/ft_trainer.py): one kill, its step counters and state."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CLI, SCRIPTS, free_port

pytest.importorskip("torchft")

# group 0 must outlive group 1's restarts (about 10 to 15 s each here, more on a busy machine): it pauses a step while
# the quorum is short of a group (steps 6 to 36 and 36 to 60 give 30 s and 24 s), and runs at full speed otherwise
STEPS, STEP_SECONDS = 60, 1.0
LATE_KILL = 36  # the second kill's step: after group 1 has healed from the first
SPREAD = 0.092  # the final loss of 3 uninterrupted seeds ranged over 0.092 (docs/fault_tolerance.md)
GLOBAL_BATCH = 16  # ft_loop.py: 4 samples a process, 2 processes a group, 2 groups


def _launch_groups(out: Path, scripts: list[list[str]], flags: tuple[str, ...] = ()) -> None:
    """Replica groups 0, 1, ... (one per script), each `hf-backend launch --fault_tolerance` of 2 processes running
    its script; group 0's launcher serves the lighthouse. The launcher's defaults for a replica group: 3 restarts, no
    hang watch."""
    port, count = free_port(), len(scripts)
    logs = [open(out / f"group{replica}.log", "w") for replica in range(count)]  # noqa: SIM115
    groups = []
    try:
        for replica in range(count):
            where = ["--lighthouse_port", str(port)] if replica == 0 else ["--lighthouse", f"http://127.0.0.1:{port}"]
            groups.append(subprocess.Popen(
                [*CLI, "launch", "--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
                 "--fault_tolerance", "--replica_id", str(replica), "--num_replica_groups", str(count), *where,
                 *flags, *scripts[replica]], env={**os.environ, "PYTHONPATH": str(SCRIPTS)},
                stdout=subprocess.DEVNULL, stderr=logs[replica]))
            if replica == 0:  # its lighthouse up before group 1 asks it
                _wait_for(out / "group0.log", "torchft lighthouse at")
        codes = [group.wait(timeout=400) for group in groups]
    finally:
        for group in groups:
            group.kill()
        for log in logs:
            log.close()
    assert codes == [0] * count, (codes, (out / "group1.log").read_text()[-3000:])


def _run(tmp: Path, name: str, kills: tuple[str, ...] = (), seed: int = 0, steps: int = STEPS,
         flags: tuple[str, ...] = (), groups: int = 2) -> dict:
    """ft_loop.py in `groups` replica groups; paced (STEP_SECONDS a step while a group is missing) only where a
    process is killed, so that the live groups outlive its restart."""
    out = tmp / name
    out.mkdir()
    pace = STEP_SECONDS if kills else 0.0
    _launch_groups(out, [[str(SCRIPTS / "ft_loop.py"), "--steps", str(steps), "--step-seconds", str(pace),
                          "--seed", str(seed), "--out", str(out / f"group{replica}.json"), "--events",
                          str(out / "events.jsonl"), *[a for kill in kills for a in ("--kill", kill)]]
                         for replica in range(groups)], flags)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return {"groups": [json.loads((out / f"group{r}.json").read_text()) for r in range(groups)], "events": events}


def _wait_for(log: Path, text: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)


@pytest.mark.skipif(sys.platform != "linux", reason="torch elastic restarts on Linux")
def test_killed_groups_heal_from_the_live_group_and_the_groups_end_equal(tmp_path):
    """Two kills in group 1: a process between two steps (the group never joins the next step's quorum), then,
    once healed, another as the gradients are exchanged (the quorum formed with it: the step fails in group 0 too).
    """
    r = random.Random(46)
    first, second = (r.randint(2, 6), r.randint(0, 1)), (LATE_KILL, r.randint(0, 1))
    whole = _run(tmp_path, "whole")
    killed = _run(tmp_path, "killed", (f"1:{first[1]}:{first[0]}:stepped:0", f"1:{second[1]}:{second[0]}:allreduce:1"))
    events = killed["events"]
    assert [(e["replica"], e["rank"], e["step"], e["where"]) for e in events if e["event"] == "kill"] == [
        (1, first[1], first[0], "stepped"), (1, second[1], second[0], "allreduce")]

    # group 0 kept stepping, alone for a while, never pausing for a quorum timeout
    steps0 = [e for e in events if e["event"] == "step" and e["replica"] == 0 and e["rank"] == 0]
    assert any(e["participants"] == 1 for e in steps0 if e["step"] > first[0])
    assert max(b["t"] - a["t"] for a, b in zip(steps0, steps0[1:])) < 30
    for restart, killed_at in ((1, first[0]), (2, second[0])):
        # group 1 restarted and went on from the live group's step (in the step it healed in, it received the
        # average of group 0's gradients without giving its own: 1 participant), then with it
        back = [e for e in events if e["event"] == "step" and e["replica"] == 1 and e["restart"] == restart]
        assert back and back[0]["step"] > killed_at + 1 and back[-1]["participants"] == 2, (restart, back[:3])
    assert not list(tmp_path.rglob("checkpoint*"))  # nothing on disk to resume from

    for run in (whole, killed):
        group0, group1 = run["groups"]
        assert group0["committed"] == group1["committed"] == STEPS
        assert group0["params"] == group1["params"]  # bitwise, every tensor
    assert whole["groups"][0]["discarded"] == 0
    # the step whose exchange group 1 died in was discarded in group 0 too
    assert killed["groups"][0]["discarded"] >= 1
    # every applied step trained a whole global batch, each sample once (while group 1 was missing or healing, its
    # gradients counting for nothing, group 0 trained group 1's part too), and the steps trained the uninterrupted
    # run's batches in its order, but for the discarded steps' (never trained)
    batches, uninterrupted_batches = _trained_batches(events), iter(_trained_batches(whole["events"]))
    discarded = killed["groups"][0]["discarded"]
    assert all(any(b == u for u in uninterrupted_batches) for b in batches[:STEPS - discarded])
    notes = (tmp_path / "killed" / "group0.log").read_text()
    assert f"its {GLOBAL_BATCH} samples are not trained" in notes
    assert "the live groups train the missing groups' parts of the batches" in notes
    # so the run with kills ends near the uninterrupted one (the loss of the final weights on a fixed set): within
    # a tenth of the spread of uninterrupted seeds (docs/fault_tolerance.md)
    final, uninterrupted = killed["groups"][0]["final_loss"], whole["groups"][0]["final_loss"]
    print(f"final loss: killed {final:.4f}, uninterrupted {uninterrupted:.4f}")
    assert abs(final - uninterrupted) < SPREAD / 10


def _trained_batches(events: list[dict]) -> list[list[int]]:
    """Each applied step's samples over the groups that took part in it, in step order: a whole global batch,
    each sample once."""
    trained: dict[int, list[int]] = {}
    for e in events:
        if e["event"] == "step" and e["rank"] == 0 and e["applied"] and e["participating"]:
            trained.setdefault(e["step"], []).extend(e["samples"])
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert all(len(set(samples)) == len(samples) == GLOBAL_BATCH for samples in trained.values())
    return [sorted(trained[step]) for step in sorted(trained)]


DILOCO_STEPS, DILOCO_KILL = 40, 6


@pytest.mark.skipif(sys.platform != "linux", reason="torch elastic restarts on Linux")
def test_groups_meeting_every_4_steps_heal_at_a_meeting_and_end_equal(tmp_path):
    """DiLoCo between the groups (`--sync_every 4 --outer_lr 0.7 --outer_momentum 0.9`): each group steps alone and
    every 4 steps the groups average their moves and take the outer step. A process of group 1 dies after its
    forward at step 6: group 0 goes on meeting alone; restarted, group 1 receives group 0's state (weights, inner
    and outer optimizer, position) at a meeting, and the groups end after 40 steps bitwise equal."""
    run = _run(tmp_path, "diloco", (f"1:1:{DILOCO_KILL}:forward:0",), steps=DILOCO_STEPS,
               flags=("--sync_every", "4", "--outer_lr", "0.7", "--outer_momentum", "0.9"))
    group0, group1 = run["groups"]
    assert group0["committed"] == group1["committed"] == DILOCO_STEPS and group0["discarded"] == 0
    assert group0["params"] == group1["params"]
    steps0 = [e for e in run["events"] if e["event"] == "step" and e["replica"] == 0 and e["rank"] == 0]
    assert max(b["t"] - a["t"] for a, b in zip(steps0, steps0[1:])) < 30
    back = [e for e in run["events"] if e["event"] == "step" and e["replica"] == 1 and e["restart"] == 1]
    assert back and back[-1]["participants"] == 2
    first = group0["losses"][min(group0["losses"], key=int)]
    print(f"DiLoCo: training loss at the first step {first:.4f}, loss of the final weights {group0['final_loss']:.4f}")
    assert group0["final_loss"] < first / 2  # it learned, through the kill


TRAINER_STEPS, TRAINER_KILL = 30, 8


@pytest.mark.skipif(sys.platform != "linux", reason="torch elastic restarts on Linux")
def test_the_trainer_counts_applied_steps_and_a_healed_group_takes_the_live_groups_state(tmp_path):
    """hf_backend.Trainer in 2 replica groups: a process of group 1 dies in step 8's gradient exchange. The step
    is discarded in group 0 too and not counted (global_step counts applied steps: both groups end at max_steps,
    group 0's log has every step once); group 1 restarts, takes group 0's TrainerState (global step, epoch) with
    the weights, and the groups end bitwise equal. Only group 0 writes checkpoints into the shared output_dir. Each
    group evaluates the whole held-out set, not its part of each global batch."""
    _launch_groups(tmp_path, [[str(SCRIPTS / "ft_trainer.py"), "--steps", str(TRAINER_STEPS), "--step-seconds",
                               str(STEP_SECONDS), "--out", str(tmp_path / f"group{replica}.json"), "--events",
                               str(tmp_path / "events.jsonl"), "--output-dir", str(tmp_path / "run"),
                               "--kill", f"1:1:{TRAINER_KILL}"] for replica in (0, 1)])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    group0, group1 = (json.loads((tmp_path / f"group{r}.json").read_text()) for r in (0, 1))
    assert group0["global_step"] == group1["global_step"] == TRAINER_STEPS
    assert group0["discarded"] == 1 and group0["logged_steps"] == list(range(1, TRAINER_STEPS + 1))
    assert group0["params"] == group1["params"]
    for group in (group0, group1):
        assert abs(group["eval_loss"] - group["whole_set_loss"]) < 1e-5, group
    steps0 = [e for e in events if e["replica"] == 0 and e["rank"] == 0]
    assert [e["global_step"] for e in steps0].count(TRAINER_KILL) == 2  # the discarded step, then the same again
    epoch_at = {e["global_step"]: e["epoch"] for e in steps0}
    back = [e for e in events if e["replica"] == 1 and e["restart"] == 1]
    assert back and back[0]["global_step"] > TRAINER_KILL + 1, back[:2]
    assert all(e["epoch"] == epoch_at[e["global_step"]] for e in back)  # the live group's count, not its own
    assert back[-1]["participants"] == 2
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20",
                                                                              "checkpoint-30"]


def test_fault_tolerance_without_the_launcher_settings_is_one_line(monkeypatch) -> None:
    from hf_backend.config import environment as env
    from hf_backend.core.errors import HfBackendError
    from hf_backend.fault_tolerance import FaultTolerance, resolve

    monkeypatch.delenv(env.FAULT_TOLERANCE, raising=False)
    with pytest.raises(HfBackendError, match="start each group with `hf-backend launch --fault_tolerance"):
        resolve(True)
    assert resolve(None) is None and resolve(False) is None
    with pytest.raises(HfBackendError, match="the id counts the groups from 0"):
        FaultTolerance(replica_id=2, num_replica_groups=2, lighthouse="http://x:1")
    assert resolve({"replica_id": 1, "num_replica_groups": 3, "lighthouse": "http://x:1"}) == FaultTolerance(
        1, 3, "http://x:1")
    with pytest.raises(HfBackendError, match="give sync_every >= 1, outer_lr > 0 and 0 <= outer_momentum < 1"):
        FaultTolerance(replica_id=0, num_replica_groups=2, lighthouse="http://x:1", outer_momentum=1.0)


def test_the_launchers_flags_reach_every_process_as_one_value(monkeypatch) -> None:
    """`hf-backend launch --replica_id 1 ...` (any of the flags implies --fault_tolerance): one JSON variable, which
    `Accelerator()` reads without being asked (fault_tolerance=None follows the launcher)."""
    from hf_backend.cli.launch import effective_config, process_environment
    from hf_backend.cli.main import build_parser
    from hf_backend.config import environment as env
    from hf_backend.fault_tolerance import FaultTolerance, resolve

    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "2", "--replica_id", "1",
                                      "--num_replica_groups", "3", "--lighthouse", "http://h:7", "--min_replicas",
                                      "2", "x.py"])
    config, path = effective_config(args)
    variables = process_environment(config, args, path)
    assert config.fault_tolerance and variables["HF_BACKEND_HANG_TIMEOUT"] == "0"
    monkeypatch.setenv(env.FAULT_TOLERANCE, variables[env.FAULT_TOLERANCE])
    assert resolve(None) == FaultTolerance(1, 3, "http://h:7", min_replicas=2)


def test_a_replica_group_without_the_lighthouses_address_is_one_line(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    proc = subprocess.run([*CLI, "launch", "--cpu", "--replica_id", "1", str(script)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "replica group 1 needs --lighthouse http://HOST:PORT" in proc.stderr


class _Quorum:
    """What ReplicaGroups asks torchft's Manager about a step's quorum."""

    def __init__(self, rank: int | None, live: int) -> None:
        self.rank, self.live = rank, live

    def start_quorum(self) -> None:
        pass

    def participating_rank(self) -> int | None:
        return self.rank

    def num_participants(self) -> int:
        return self.live


def test_the_live_groups_share_the_missing_groups_parts_and_are_weighted_by_them() -> None:
    """3 replica groups of 2 processes, group 1 missing: live group 0 (rank 0 of 2) trains groups 0's and 2's parts
    of each global batch, live group 2 (rank 1) group 1's; their gradients, averaged with equal weights by torchft,
    are weighted 4/3 and 2/3 so that the average is the whole batch's. All live: each its own part, weight 1; a
    healing group (not participating): its own part (its gradients count for nothing)."""
    import torch
    from torch.utils.data import DataLoader

    from hf_backend.config.options import GradientAccumulationPlugin
    from hf_backend.data import prepare_dataloader
    from hf_backend.fault_tolerance import EveryStep, FaultTolerance
    from hf_backend.parallel.dims import DataShard
    from hf_backend.training.gradient_state import GradientState

    def group(replica: int, quorum: _Quorum) -> tuple[EveryStep, list[list[int]]]:
        groups = EveryStep.__new__(EveryStep)  # the step protocol without torchft's Manager
        groups.config = FaultTolerance(replica_id=replica, num_replica_groups=3, lighthouse="http://x:1")
        groups.manager, groups._phase, groups._wait_for_everyone = quorum, "idle", False
        groups.shard = shard = DataShard(count=2, index=1)  # process 1 of the group's 2
        across = groups.data_shard(shard)
        loader = prepare_dataloader(DataLoader(torch.arange(48), batch_size=2), num_processes=across.count,
                                    process_index=across.index, device=None, split_batches=False,
                                    even_batches=True, gradient_state=GradientState(GradientAccumulationPlugin()))
        groups._training_loader = loader
        groups.loader_prepared(loader)
        return groups, [b.tolist() for b in loader]

    # each global batch: 12 samples, 6 parts of 2 (group g, process p: part 2g + p); this process reads p = 1
    group0, batches0 = group(0, _Quorum(0, 2))
    assert batches0[0] == [2, 3, 10, 11] and group0._weight == 4 / 3
    group2, batches2 = group(2, _Quorum(1, 2))
    assert batches2[0] == [6, 7] and group2._weight == 2 / 3
    everyone, own = group(2, _Quorum(2, 3))
    assert own[0] == [10, 11] and everyone._weight == 1.0
    healing, own = group(1, _Quorum(None, 2))
    assert own[0] == [6, 7] and healing._weight == 1.0
