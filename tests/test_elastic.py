"""Restarts and elastic worlds under `hf-backend launch` (issue 20): SIGKILLed workers are restarted by torch elastic
and resume from the newest complete checkpoint by themselves, ending with the uninterrupted run's exact weights; a
two-node `--nnodes 1:2` job on loopback shrinks to one node when the other is killed and grows back when it returns,
keeping the global batch (tests/scripts/elastic_loop.py trains and records every step)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import CLI, SCRIPTS, cli, cli_env, free_port, run_script

from hf_backend.cli.launch import elastic_range, process_environment, torchrun_arguments
from hf_backend.config.schema import LaunchConfig
from hf_backend.core.errors import ConfigError

SCRIPT = str(SCRIPTS / "elastic_loop.py")
EVERY = 4


def _events(path: Path) -> list[dict]:
    """The complete lines: read while a process appends one, the file can end in part of it (no newline yet)."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def _launch(tmp: Path, name: str, launch: list[str], script: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    out, events = tmp / f"{name}.json", tmp / f"{name}.jsonl"
    proc = cli("launch", "--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1", *launch, SCRIPT,
               "--project", str(tmp / name), "--events", str(events), "--out", str(out), *script, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, {"report": json.loads(out.read_text()), "events": _events(events)}


def _uninterrupted(tmp: Path, script: list[str]) -> dict:
    """The reference run: the same script in 2 processes forked warm (tests/warm_processes.py), not through the
    launcher (whose restarts are what the tests check), so no interpreter starts for it."""
    out, events = tmp / "whole.json", tmp / "whole.jsonl"
    run_script(SCRIPT, ["--project", str(tmp / "whole"), "--events", str(events), "--out", str(out), *script], nproc=2)
    return {"report": json.loads(out.read_text()), "events": _events(events)}


def test_killed_workers_restart_and_resume_to_the_uninterrupted_weights_bitwise(tmp_path):
    whole = _uninterrupted(tmp_path, [])
    # three kills, each in a later round of restarts: a step of rank 0 or 1, a save (rank 0, inside save_state,
    # after the weights are staged), another step; the steps are drawn at random
    r = random.Random(20)
    first = r.randint(2, 10)
    save = EVERY * r.randint(first // EVERY + 1, 4)
    last = r.randint(save + 1, 22)
    plan = [(first, r.randint(0, 1), "step"), (save, 0, "save"), (last, r.randint(0, 1), "step")]
    kills = [f"{restart}:{rank}:{step}:{where}" for restart, (step, rank, where) in enumerate(plan)]
    _, run = _launch(tmp_path, "killed", ["--max_restarts", str(len(plan))],
                     [arg for k in kills for arg in ("--kill", k)])
    events = run["events"]
    assert [e["restart"] for e in events if e["event"] == "kill"] == [0, 1, 2], kills
    redone, pauses = [], []
    for restart, (step, _, where) in enumerate(plan):
        reached = max(e["step"] for e in events if e["event"] == "step" and e["restart"] == restart)
        assert reached == step  # every process got as far as the killed one
        start = [e for e in events if e["event"] == "start" and e["restart"] == restart + 1]
        resumed = {e["resumed"] for e in start}
        # a kill in a step comes before that step's save; one in a save leaves that save unsealed
        newest_complete = step - EVERY if where == "save" else (step - 1) // EVERY * EVERY
        assert resumed == {newest_complete}, (kills, start)
        redone.append(step - newest_complete)
        killed_at = next(e["t"] for e in events if e["event"] == "kill" and e["restart"] == restart)
        trained = min(e["t"] for e in events if e["event"] == "step" and e["restart"] == restart + 1)
        pauses.append((min(e["created"] for e in start) - killed_at, max(e["t"] for e in start) - killed_at,
                       trained - killed_at))
    assert all(1 <= n <= EVERY for n in redone) and redone[1] == EVERY
    assert run["report"]["steps"] == whole["report"]["steps"] == 24
    assert run["report"]["sha256"] == whole["report"]["sha256"]  # bitwise the uninterrupted run's weights
    assert run["report"]["params"] == whole["report"]["params"]
    print(f"kills {kills}: steps redone {redone}; seconds from each kill to (new workers started, checkpoint loaded, "
          f"training again): {[tuple(round(t, 1) for t in p) for p in pauses]}")


def test_the_rendezvous_can_be_entered_again():
    def arguments(*launch: str, **config) -> list[str]:
        args = argparse.Namespace(nnodes=None, rdzv_conf=None, monitor_interval=0.1, max_restarts=0, module=False,
                                  training_script="t.py", training_script_args=[])
        for item in launch:
            key, _, value = item.partition("=")
            setattr(args, key, int(value) if value.isdigit() else value)
        return torchrun_arguments(LaunchConfig(**config), args)

    assert "--standalone" in arguments(num_processes=2)  # c10d on a free port
    two = arguments(num_processes=4, num_machines=2, main_process_ip="10.0.0.1", main_process_port=6000)
    assert {"--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:6000", "--nproc_per_node=2"} <= set(two)
    static = dict(num_processes=4, num_machines=2, main_process_ip="10.0.0.1", rdzv_backend="static")
    assert "--node_rank=0" in arguments(**static)  # asked for, without restarts: still there
    with pytest.raises(ConfigError, match="static cannot be entered again"):
        arguments("max_restarts=1", **static)
    elastic = arguments("nnodes=1:2", "rdzv_conf=last_call_timeout=1", num_processes=4, num_machines=2,
                        main_process_ip="10.0.0.1")
    assert {"--nnodes=1:2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_conf=last_call_timeout=1"} <= set(
        elastic)
    assert elastic_range("1:2") == (1, 2) and elastic_range("3") == (3, 3)
    for bad in ("2:1", "0:2", "a:b"):
        with pytest.raises(ConfigError, match="--nnodes"):
            elastic_range(bad)
    # with restarts each rendezvous round gets its own store (the shared one hands a restarted group stale peer
    # addresses); without, the shared store stays (it outlives a rank that exits first)
    for restarts, nnodes, own_store in ((1, None, True), (0, "1:2", True), (0, None, False)):
        options = argparse.Namespace(num_cpu_threads_per_process=1, hang_timeout=None, max_restarts=restarts,
                                     nnodes=nnodes)
        env = process_environment(LaunchConfig(), options, None)
        assert (env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1") == own_store


def test_resume_from_checkpoint_needs_automatic_checkpoints_and_starts_fresh_without_one(tmp_path):
    import torch

    from hf_backend import Accelerator, HfBackendError, ProjectConfiguration

    model = torch.nn.Linear(2, 2)
    plain = Accelerator(cpu=True)
    with pytest.raises(HfBackendError, match="automatic_checkpoint_naming=True"):
        plain.resume_from_checkpoint()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(model)
    assert accelerator.restart_count == 0 and not accelerator.is_restart
    assert accelerator.resume_from_checkpoint() is None
    with torch.no_grad():
        model.weight.fill_(3.0)
    accelerator.save_state()
    (tmp_path / "checkpoints" / "checkpoint_1").mkdir()  # an empty newer one: passed over
    with torch.no_grad():
        model.weight.fill_(0.0)
    assert accelerator.resume_from_checkpoint() == str(tmp_path / "checkpoints" / "checkpoint_0")
    assert model.weight.eq(3.0).all()


@pytest.mark.parametrize("launcher", ["hf-backend launch", "notebook_launcher"])
def test_a_restarted_group_forms_again(launcher, tmp_path):
    """The restarted rank 0 comes late: on a store shared across rendezvous rounds, rank 1 would read its old address
    and fail with "connectFullMesh failed ... Connection refused" (tests/scripts/notebook_restart.py)."""
    out, script = tmp_path / "out.txt", str(SCRIPTS / "notebook_restart.py")
    if launcher == "notebook_launcher":  # the notebook forked warm: its workers fork from it, as in a notebook
        proc = run_script(script, [str(out), str(free_port())], timeout=120, check=False)
    else:
        proc = cli("launch", "--cpu", "--num_processes", "2", "--max_restarts", "1", script, str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == "1 4"  # restarted once, and both processes took part in both collectives


# -- a world that shrinks and grows: two launchers on loopback as two nodes ------------------------------------------
def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once, as a node that dies."""
    try:
        family = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def _wait(events: Path, condition, nodes: list[subprocess.Popen], limit: float) -> list[dict]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        seen = _events(events)
        if condition(seen):
            return seen
        if any(node.poll() not in (None, 0) for node in nodes):
            break
        time.sleep(0.2)
    raise AssertionError(f"waited {limit} s; events: {_events(events)[-6:]}")


def _listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections(kind="tcp"))


def test_a_two_node_job_shrinks_to_one_node_and_grows_back_keeping_the_global_batch(tmp_path):
    # Steps paced (0.25 s) until the job has grown back: the kill, the shrink and the new node all come while it
    # trains; then it runs out its 120 steps at full speed.
    grown = tmp_path / "grown"
    script = ["--samples", "1920", "--steps", "120", "--step-delay", "0.25", "--delay-until", str(grown),
              "--keep-global-batch"]
    whole = _uninterrupted(tmp_path, script[:4])
    events, out, port = tmp_path / "elastic.jsonl", tmp_path / "elastic.json", free_port()
    common = [*CLI, "launch", "--cpu", "--num_processes", "2", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--num_cpu_threads_per_process", "1", "--max_restarts", "3",
              "--monitor_interval", "0.5",
              "--rdzv_conf", "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5",
              SCRIPT, "--project", str(tmp_path / "elastic"), "--events", str(events), "--out", str(out), *script]
    logs, nodes = [], []

    def start(name: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        logs.append(log)
        with log.open("w") as sink:  # to a file: an unread pipe could fill and stall a node
            nodes.append(subprocess.Popen(common, stdout=sink, stderr=subprocess.STDOUT, env=cli_env()))
        return nodes[-1]

    try:
        survivor = start("a")  # first: it hosts the rendezvous store, so it must be the one that survives
        deadline = time.monotonic() + 60
        while not _listening(port) and survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        leaving = start("b")
        _wait(events, lambda seen: any(e["event"] == "step" and e["world"] == 2 and e["step"] >= 6 for e in seen),
              nodes, 90)
        killed_at = time.time()
        _kill_tree(leaving)
        seen = _wait(events, lambda seen: sum(e["event"] == "step" and e["world"] == 1 for e in seen) >= 3,
                     [survivor], 90)
        shrunk_at = min(e["t"] for e in seen if e["event"] == "step" and e["world"] == 1)
        rejoined_at = time.time()
        start("b2")
        seen = _wait(events, lambda seen: any(e["event"] == "step" and e["world"] == 2 and e["t"] > rejoined_at
                                              for e in seen), [survivor], 90)
        grown_at = min(e["t"] for e in seen if e["event"] == "step" and e["world"] == 2 and e["t"] > rejoined_at)
        grown.touch()
        deadline = time.monotonic() + 120
        while any(node.poll() is None for node in nodes[-1:] + [survivor]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert survivor.returncode == 0 and nodes[-1].returncode == 0, "\n".join(
            f"{log.name}:\n{log.read_text()[-3000:]}" for log in logs)
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_tree(node)
    seen = _events(events)
    starts = [e for e in seen if e["event"] == "start"]
    small = [e for e in starts if e["world"] == 1]
    assert small and all(e["accumulation"] == 2 for e in small)  # one process, two batches: the same global batch
    assert all(e["accumulation"] == 1 for e in starts if e["world"] == 2)
    # each optimizer step is the same step of the uninterrupted run: as many steps, the same learning rates
    reference = {e["step"]: e["lr"] for e in whole["events"] if e["event"] == "step"}
    assert all(reference[e["step"]] == e["lr"] for e in seen if e["event"] == "step")
    report = json.loads(out.read_text())
    assert report["steps"] == whole["report"]["steps"] == 120 and report["world"] == 2
    # bitwise: one process accumulating loss/2 of each half sums g1/2 + g2/2, DDP averages (g1 + g2)/2, and halving
    # is exact in floating point (barring underflow); with a world ratio that is not a power of two it is not
    assert report["sha256"] == whole["report"]["sha256"]
    redone = []
    for before, after in ((2, 1), (1, 2)):
        start = min(e["t"] for e in seen if e["event"] == "start" and e["world"] == after
                    and e["t"] > (killed_at if after == 1 else rejoined_at))
        reached = max(e["step"] for e in seen if e["event"] == "step" and e["world"] == before and e["t"] < start)
        resumed = next(e["resumed"] for e in seen if e["event"] == "start" and e["t"] >= start)
        redone.append(reached - resumed)
    assert all(0 <= n <= EVERY for n in redone), redone
    print(f"shrink: {shrunk_at - killed_at:.1f} s from the kill to training on one node; grow: "
          f"{grown_at - rejoined_at:.1f} s from the new node's start to training on two; steps redone {redone}")
