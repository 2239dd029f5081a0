"""`hf-backend launch` and signals: SIGTERM / SIGINT stop the workers in one line and exit 143 / 130, a SIGKILLed
launcher leaves no workers behind, and a failed worker's summary keeps its error's message, not its last line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from helpers import CLI, cli_env, free_port

from hf_backend.launch.worker_failures import describe_failure, one_line

# Each worker writes its pid to <dir>/pid<local rank>, then waits to be stopped; no process group, no collectives.
SLEEPER = """\
import os, sys, time
path = os.path.join(sys.argv[1], "pid" + os.environ["LOCAL_RANK"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
while True:
    time.sleep(0.1)
"""
# Rank 1 fails with a pydantic-shaped message (the key on line 2, a URL last); rank 0 waits to be stopped.
PYDANTIC_MESSAGE = ("1 validation error for DeepSpeedZeroConfig\noverlap_comn\n  Extra inputs are not permitted "
                    "[type=extra_forbidden]\n    For further information visit https://errors.pydantic.dev/2/v/x")
FAILER = f"""\
import os, time
if os.environ["LOCAL_RANK"] == "1":
    raise ValueError({PYDANTIC_MESSAGE!r})
while True:
    time.sleep(0.1)
"""
TIMEOUT = 60  # seconds for any one wait; pytest-timeout bounds each test
pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a (slow) reaper to collect it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _launch(tmp_path: Path, source: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "script.py"
    script.write_text(source)
    log = tmp_path / "launcher.err"
    args = ["launch", "--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), str(script), str(tmp_path)]
    with log.open("w") as sink:  # a file, never an unread pipe that workers could keep open
        launcher = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=sink, env=cli_env(
            HF_HOME=str(tmp_path)))
    return launcher, log


def _worker_pids(tmp_path: Path, launcher: subprocess.Popen) -> list[int]:
    files = [tmp_path / f"pid{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    while not all(f.exists() for f in files):
        assert launcher.poll() is None, f"the launcher exited {launcher.returncode} before both workers started"
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.fixture
def cleanup():
    """SIGKILL whatever a failed test left running."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_workers_in_one_line(tmp_path, cleanup, sig, code):
    launcher, log = _launch(tmp_path, SLEEPER)
    cleanup.append(launcher.pid)
    workers = _worker_pids(tmp_path, launcher)
    cleanup.extend(workers)
    launcher.send_signal(sig)
    assert launcher.wait(TIMEOUT) == code, log.read_text()[-3000:]
    assert log.read_text() == f"hf-backend launch: stopped by {sig.name}; workers stopped\n"
    assert _wait_gone(workers, 1) == []


def test_workers_die_with_a_sigkilled_launcher(tmp_path, cleanup):
    launcher, log = _launch(tmp_path, SLEEPER)
    cleanup.append(launcher.pid)
    workers = _worker_pids(tmp_path, launcher)
    cleanup.extend(workers)
    launcher.kill()
    launcher.wait(TIMEOUT)
    assert _wait_gone(workers, 5) == [], f"orphaned workers; launcher log:\n{log.read_text()[-3000:]}"


def test_the_failure_summary_keeps_the_errors_message_not_its_last_line(tmp_path, cleanup):
    launcher, log = _launch(tmp_path, FAILER)
    cleanup.append(launcher.pid)
    assert launcher.wait(TIMEOUT) == 1
    last = log.read_text().strip().splitlines()[-1]
    assert last == ("hf-backend launch: rank 1 (local rank 1) exited with code 1: ValueError: 1 validation error for "
                    "DeepSpeedZeroConfig | overlap_comn | Extra inputs are not permitted [type=extra_forbidden] | "
                    "For further information visit https://errors.pydantic.dev/2/v/x; the other workers were stopped")


def test_one_line_is_bounded():
    assert one_line("  a\n\n  b  \nc") == "a | b | c"
    long = one_line("KeyError: " + "x" * 1000)
    assert len(long) == 300 and long.startswith("KeyError: xxx") and long.endswith("...")


def test_the_summary_names_the_rank_that_raised_first_by_its_error():
    """torch stamps a worker without an error file with the whole second it looked, which can come before the exact
    time the failing rank recorded: the stopped rank must still come last."""
    recorded = {"message": {"message": "ValueError: boom\nhttps://x", "extraInfo": {"time": 100.9, "timestamp": "100"}}}
    failing = SimpleNamespace(local_rank=1, exitcode=1, message=recorded["message"], error_file_data=recorded,
                              timestamp=100)
    stopped = SimpleNamespace(local_rank=0, exitcode=-15, message="Signal 15 (SIGTERM) received by PID 1",
                              error_file_data={"message": "<NONE>"}, timestamp=100, signal_name=lambda: "SIGTERM")
    err = SimpleNamespace(failures={0: stopped, 1: failing})
    assert describe_failure(err) == ("rank 1 (local rank 1) exited with code 1: ValueError: boom | https://x; "
                                     "the other workers were stopped")
    # It raised first but was still exiting when the launcher stopped it: its error, not the signal, is the news.
    failing.exitcode, failing.signal_name = -15, lambda: "SIGTERM"
    assert describe_failure(err) == ("rank 1 (local rank 1) failed: ValueError: boom | https://x; "
                                     "the other workers were stopped")


def test_the_watchdog_kills_a_worker_whose_parent_died(tmp_path):
    """The fallback where there is no parent-death signal (not Linux): a thread polling the parent's pid."""
    child = textwrap.dedent("""\
        import os, sys, threading, time
        from hf_backend.cli import worker
        threading.Thread(target=worker._watch_parent, args=(os.getppid(),), daemon=True).start()
        print(os.getpid(), flush=True)
        time.sleep(60)
        """)
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); sys.stdin.read(1)"
    middle = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=cli_env())
    pid = 0
    try:
        pid = int(middle.stdout.readline())
        assert _alive(pid)
        middle.kill()
        middle.wait(TIMEOUT)
        assert _wait_gone([pid], 5) == []
    finally:
        for process in (middle.pid, pid):
            if process and _alive(process):
                os.kill(process, signal.SIGKILL)
        middle.wait(TIMEOUT)
