"""Hangs that name their rank (launch/hang_watch.py): a script whose rank 1 skips a collective (early stopping on
a per-rank metric) fails at once under `--debug` in one line naming each rank's operation and call site, and without
it ends after the hang timeout with every rank's stacks and one line naming where each waits, under `hf-backend
launch` and plain torchrun alike; no process is left behind."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import FrameType

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import CLI, SCRIPTS, cli, cli_env, run_script

from hf_backend.launch import hang_watch

SCRIPT = "early_stop_hang.py"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(150)


def _line_of(marker: str) -> int:
    lines = (SCRIPTS / SCRIPT).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


BACKWARD, BARRIER = _line_of("# rank 0 waits here"), _line_of("# rank 1 waits here")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run(tmp_path: Path, command: list[str], **env: str) -> tuple[int, str, float]:
    """Run `command` in tmp_path (the script copied there, so call sites read `early_stop_hang.py:N`); its exit code,
    its output and when it exited. Every process it started is SIGKILLed afterwards, whatever happened."""
    shutil.copy(SCRIPTS / SCRIPT, tmp_path / SCRIPT)  # (unused by a test that brings its own script)
    log = tmp_path / "out.log"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("w") as sink:  # a file, never an unread pipe that workers could keep open
        process = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
                                   env=cli_env(PYTHONPATH=path, OMP_NUM_THREADS="1", **env), start_new_session=True)
    try:
        code = process.wait(120)
        ended = time.time()
    finally:
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
        leftover = [pid for pid in pids if _alive(pid)]
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert len(pids) == 2, f"the workers did not start:\n{log.read_text()[-4000:]}"
    assert leftover == [], f"workers left running: {leftover}"
    return code, log.read_text(), ended


def _hang_started(tmp_path: Path) -> float:
    return float((tmp_path / "stopped").read_text())


LAUNCH = [*CLI, "launch", "--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "1"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--monitor_interval", "0.1"]
MISMATCH = (f"collective mismatch: rank 0 calls all_reduce (ALLREDUCE of Float[5]) at {SCRIPT}:{BACKWARD}; "
            f"rank 1 calls barrier at {SCRIPT}:{BARRIER}")
# Now and then torch raises on one rank only (seen once in about 25 runs): the other's watchdog answers for it.
ONE_SIDED_MISMATCH = re.compile(
    rf"collective mismatch: (rank 0 waiting in (all_reduce|backward) at {SCRIPT}:{BACKWARD}; rank 1 calls barrier at "
    rf"{SCRIPT}:{BARRIER}|rank 0 calls all_reduce \(ALLREDUCE of Float\[5\]\) at {SCRIPT}:{BACKWARD}; rank 1 "
    rf"waiting in barrier at {SCRIPT}:{BARRIER})")


def _mismatch_lines(lines: list[str], prefix: str) -> list[str]:
    """The lines that report early_stop_hang.py's mismatch: both ranks raised, or one raised and the other answered."""
    return [line for line in lines if line.startswith(prefix) and (
        line[len(prefix):] == MISMATCH or ONE_SIDED_MISMATCH.fullmatch(line[len(prefix):]))]
TIMEOUT = 2  # the hang timeout of the tests that wait for one: well above a step of early_stop_hang.py
HANG = (f"hang: no rank made progress for {TIMEOUT} s: rank 0 waiting in backward at {SCRIPT}:{BACKWARD}; "
        f"rank 1 waiting in barrier at {SCRIPT}:{BARRIER}")


def _assert_stacks(output: str) -> None:
    """Each rank printed its header and its main thread's stack, down to the line where it waits."""
    for rank, (op, line) in enumerate([("backward", BACKWARD), ("barrier", BARRIER)]):
        header = f"hf_backend: rank {rank} has waited "
        assert header in output, output[-4000:]
        stack = output.split(header, 1)[1]
        assert f"s in {op} at {SCRIPT}:{line}; the stacks of its threads:" in stack.splitlines()[0]
        assert f'[rank{rank}]: Thread MainThread (it set up the process group), most recent call last:' in stack
        assert re.search(rf'\[rank{rank}\]:   File "[^"]*{SCRIPT}", line {line}, in <module>', stack), stack[:3000]


def test_debug_names_the_mismatch_at_once(tmp_path):
    code, output, ended = _run(tmp_path, [*LAUNCH, "--debug", SCRIPT, str(tmp_path)])
    assert code == 1, output[-4000:]
    last = output.strip().splitlines()[-1]
    assert last.endswith("; the workers were stopped") and _mismatch_lines(
        [last.removesuffix("; the workers were stopped")], "hf-backend launch: "), output[-4000:]
    took = ended - _hang_started(tmp_path)
    print(f"from rank 1 skipping the all-reduce to the launcher's exit: {took:.2f} s")
    assert took < 4  # torch's check is immediate, and so is the peers' exchange of their call sites


def test_a_hang_ends_after_the_timeout_naming_every_rank(tmp_path):
    code, output, ended = _run(tmp_path, [*LAUNCH, "--hang_timeout", str(TIMEOUT), SCRIPT, str(tmp_path)])
    assert code == 1, output[-4000:]
    assert output.strip().splitlines()[-1] == (f"hf-backend launch: {HANG}; every rank's stacks are above; "
                                               "the workers were stopped")
    _assert_stacks(output)
    assert "Connection closed" not in output  # a rank whose peer finished reporting first stays quiet
    took = ended - _hang_started(tmp_path)
    print(f"from the hang to the launcher's exit (timeout {TIMEOUT} s): {took:.2f} s")
    assert TIMEOUT <= took < TIMEOUT + 8


@pytest.mark.parametrize("debug", [False, True], ids=["hang", "mismatch"])
def test_plain_torchrun_gets_the_same_report_from_the_ranks(tmp_path, debug):
    # Plain torchrun: the watch (and the mismatch's one line) only when the script passes a HangWatch.
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if debug else {}
    timeout = 300 if debug else TIMEOUT
    code, output, ended = _run(tmp_path, [*TORCHRUN, SCRIPT, str(tmp_path), str(timeout)], **env)
    assert code == 1, output[-4000:]
    lines = output.splitlines()
    if debug:
        said = [line for line in lines if line.startswith("hf_backend: ")]
        assert len(_mismatch_lines(lines, "hf_backend: ")) == 1, "\n".join(said) + "\n" + output[-4000:]
    else:
        assert lines.count(f"hf_backend: {HANG}") == 1, output[-4000:]
    if not debug:
        _assert_stacks(output)
    took = ended - _hang_started(tmp_path)
    assert took < (4 if debug else TIMEOUT + 8)


# Rank 1 is done (its loop ended a step early) while rank 0 reduces once more.
DONE_EARLY = """\
import os, sys
import torch
from hf_backend import Accelerator
accelerator = Accelerator(cpu=True)
with open(os.path.join(sys.argv[1], f"pid{accelerator.process_index}"), "w") as f:
    f.write(str(os.getpid()))
if accelerator.is_main_process:
    accelerator.reduce(torch.ones(3))
"""


def test_debug_names_a_rank_that_exited(tmp_path):
    (tmp_path / "done.py").write_text(DONE_EARLY)
    code, output, _ = _run(tmp_path, [*LAUNCH, "--debug", "done.py", str(tmp_path)])
    assert code == 1, output[-4000:]
    assert output.strip().splitlines()[-1] == ("hf-backend launch: collective mismatch: rank 0 calls all_reduce at "
                                               "done.py:8; rank 1 exited; the workers were stopped")


# torch raises on one rank only: rank 0's monitored barrier gives up on rank 1, which is stuck outside any collective
# (a data loader, a lock) and gets no error. Rank 1's watchdog answers rank 0 with where it stands still.
ONE_SIDED = """\
import datetime, os, sys, time
import torch.distributed as dist
from hf_backend import Accelerator
from hf_backend.launch.hang_watch import HangWatch
accelerator = Accelerator(cpu=True, kwargs_handlers=[HangWatch(300)] if sys.argv[2:] else [])
with open(os.path.join(sys.argv[1], f"pid{accelerator.process_index}"), "w") as f:
    f.write(str(os.getpid()))
def next_batch():
    time.sleep(60)  # rank 1 waits here
if accelerator.is_main_process:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
else:
    next_batch()
"""


@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_a_rank_that_got_no_error_answers_with_where_it_waits(tmp_path, launcher):
    (tmp_path / "one_sided.py").write_text(ONE_SIDED)
    command = [*LAUNCH, "one_sided.py"] if launcher == "launch" else [*TORCHRUN, "one_sided.py"]
    asked = [] if launcher == "launch" else ["watch"]  # the launcher installs the watch itself
    code, output, _ = _run(tmp_path, [*command, str(tmp_path), *asked])
    assert code == 1, output[-4000:]
    line = ("collective mismatch: rank 0 calls monitored_barrier at one_sided.py:11; rank 1 waiting in next_batch at "
            "one_sided.py:9")
    if launcher == "launch":
        assert output.strip().splitlines()[-1] == f"hf-backend launch: {line}; the workers were stopped"
    else:
        assert output.splitlines().count(f"hf_backend: {line}") == 1, output[-4000:]


# Rank 0 computes for 2 s (its frames move) while rank 1 waits in a barrier: not a hang, even with a 1 s timeout.
# Then (with "hang"), a real one: rank 1 skips a reduce and waits at the end.
BUSY = """\
import os, sys, time
import torch
from hf_backend import Accelerator, add_process_group_plugin
from hf_backend.launch.hang_watch import HangWatch
add_process_group_plugin(HangWatch(float(sys.argv[3])))  # as a script with a Trainer would
accelerator = Accelerator(cpu=True)
with open(os.path.join(sys.argv[1], f"pid{accelerator.process_index}"), "w") as f:
    f.write(str(os.getpid()))
if accelerator.is_main_process:
    end = time.monotonic() + 2
    while time.monotonic() < end:
        torch.randn(64, 64) @ torch.randn(64, 64)
accelerator.wait_for_everyone()
os.write(1, f"finished {accelerator.process_index}\\n".encode())  # one write: the ranks' lines do not interleave
if sys.argv[2] == "hang" and accelerator.is_main_process:
    accelerator.reduce(torch.ones(2))
accelerator.wait_for_everyone()
"""


def test_a_busy_rank_is_progress_and_the_watchdog_still_sees_a_later_hang(tmp_path):
    (tmp_path / "busy.py").write_text(BUSY)
    code, output, _ = _run(tmp_path, [*TORCHRUN, "busy.py", str(tmp_path), "hang", "1"])
    assert code == 1 and "finished 0" in output and "finished 1" in output, output[-4000:]
    reduce = BUSY.splitlines().index("    accelerator.reduce(torch.ones(2))") + 1
    assert (f"hf_backend: hang: no rank made progress for 1 s: rank 0 waiting in all_reduce at busy.py:{reduce}; "
            f"rank 1 waiting in barrier at busy.py:{reduce + 1}") in output.splitlines(), output[-4000:]


def test_a_timeout_past_the_groups_is_a_warning(tmp_path):
    """The main process warns as its watchdog starts (no launcher involved: the ranks are forked warm)."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    proc = run_script(script, [str(tmp_path), "no", "1800"], nproc=2)
    output = proc.stdout + proc.stderr
    assert "finished 0" in output and "finished 1" in output, output[-4000:]
    warning = ("hf_backend: the hang timeout (1800 s) is not below the process group's timeout (1800 s): a hung "
               "collective times out first, without the ranks' stacks; lower it, or raise the group's timeout")
    assert [line for line in output.splitlines() if "is not below" in line] == [warning], output[-4000:]  # rank 0


def test_the_timeout_is_read_once_and_checked(monkeypatch):
    monkeypatch.delenv(hang_watch.TIMEOUT_VARIABLE, raising=False)
    assert hang_watch.hang_timeout() == 0  # not asked for: no watchdog (hf-backend launch sets DEFAULT_TIMEOUT)
    monkeypatch.setenv(hang_watch.TIMEOUT_VARIABLE, "0")
    assert hang_watch.hang_timeout() == 0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(hang_watch.TIMEOUT_VARIABLE, bad)
        with pytest.raises(Exception, match=f"{hang_watch.TIMEOUT_VARIABLE}='{bad}' is not a number of seconds"):
            hang_watch.hang_timeout()
    for bad in (-1, "300", float("nan"), True):
        with pytest.raises(Exception, match=r"HangWatch\(timeout\)=.* is not a number of seconds >= 0"):
            hang_watch.HangWatch(bad)


def test_a_bad_hang_timeout_is_one_line_before_any_worker_starts(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    bad_flag = cli("launch", "--cpu", "--num_processes", "2", "--hang_timeout", "-1", str(script))
    assert (bad_flag.returncode, bad_flag.stderr) == (2, "hf-backend launch: error: launch: --hang_timeout -1 is "
                                                         "negative; give seconds, or 0 to turn the hang watchdog off\n")
    bad_env = cli("launch", "--cpu", "--num_processes", "2", str(script), **{hang_watch.TIMEOUT_VARIABLE: "5m"})
    assert (bad_env.returncode, bad_env.stderr) == (2, f"hf-backend launch: error: environment variable "
                                                       f"{hang_watch.TIMEOUT_VARIABLE}='5m' is not a number of seconds "
                                                       ">= 0; set e.g. 300, or 0 to turn the hang watchdog off\n")


def test_a_peers_own_record_wins_over_its_watchdogs_answer(monkeypatch):
    """In one process, a gloo group of one standing for rank 0 of two: rank 1's watchdog answer counts only when no
    record of rank 1's own error follows it within ANSWER_GRACE."""
    monkeypatch.setattr(hang_watch, "_explaining", threading.Event())  # _explain sets it for the process's life
    monkeypatch.setattr(hang_watch, "ANSWER_GRACE", 1.5)  # (0.5 s) a margin for the timer below on a loaded machine
    text = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[5], TensorDtypes=Float), but Rank 1 is running "
            "collective: CollectiveFingerPrint(SequenceNumber=1, OpType=BARRIER).")

    def explained() -> tuple[str, float]:
        try:
            raise RuntimeError(text)
        except RuntimeError as error:
            started = time.monotonic()
            line = hang_watch.explain(error)
            return line, time.monotonic() - started

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = hang_watch._store()
        store.set(hang_watch._key("answer", 1), json.dumps({"state": "waiting", "op": "all_reduce",
                                                            "site": "train.py:9"}))
        own = json.dumps({"op": "barrier", "detail": "BARRIER", "site": "train.py:12"})
        raised = threading.Timer(0.2, store.set, [hang_watch._key("mismatch", 1), own])
        raised.start()
        line, took = explained()
        raised.join()
        assert line.endswith("; rank 1 calls barrier at train.py:12") and took < 1.5, (line, took)
        store.delete_key(hang_watch._key("mismatch", 1))
        line, took = explained()
        assert line.endswith("; rank 1 waiting in all_reduce at train.py:9"), line
        assert hang_watch.ANSWER_GRACE <= took < hang_watch.EXCHANGE_SECONDS
    finally:
        dist.destroy_process_group()


def test_the_lowest_rank_that_torch_raised_on_prints_the_line():
    assert hang_watch.printing_rank(MISMATCH) == 0
    assert hang_watch.printing_rank(f"collective mismatch: rank 0 waiting in backward at {SCRIPT}:{BACKWARD}; rank 1 "
                                    f"calls barrier at {SCRIPT}:{BARRIER}") == 1
    assert hang_watch.printing_rank("collective mismatch: rank 0 in no collective (it did not answer in 5 s); rank 2 "
                                    "calls barrier at a.py:3; rank 3 calls all_reduce at a.py:2") == 2


def test_where_names_the_collective_and_the_users_line():
    def user_code():
        import sys as _sys

        return hang_watch.where(_sys._getframe())

    op, site = user_code()
    assert op == "user_code"
    assert site == f"{os.path.relpath(__file__)}:{user_code.__code__.co_firstlineno + 3}"


def test_the_summary_says_which_ranks_exited_and_the_fingerprint_is_short():
    records = [{"state": "waiting", "op": "all_reduce", "site": "train.py:42"}, {"state": "exited"},
               {"state": "waiting", "op": "barrier", "site": "train.py:50"}]
    assert hang_watch.hang_summary(records, 300) == ("hang: no rank made progress for 300 s: rank 0 waiting in "
                                                     "all_reduce at train.py:42; rank 1 exited; rank 2 waiting in "
                                                     "barrier at train.py:50")
    torch_print = ("SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[5, 2], TensorDtypes=Float, TensorDeviceTypes="
                   "TensorOptions(dtype=float (default), device=cpu, memory_format=(nullopt))")
    assert hang_watch._fingerprint(torch_print) == "ALLREDUCE of Float[5, 2]"
    assert hang_watch._fingerprint("SequenceNumber=0OpType=BARRIER") == "BARRIER"


def test_where_falls_back_to_library_code_when_no_frame_is_the_users():
    """A script installed as a package: every frame is under a library root; the innermost one outside torch and
    hf_backend is named, never a frozen module."""
    import threading

    event = threading.Event()
    thread = threading.Thread(target=event.wait, args=(30,), daemon=True)  # only threading.py's frames
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while sys._current_frames()[thread.ident].f_code.co_name != "wait" and time.monotonic() < deadline:
            time.sleep(0.01)
        op, site = hang_watch.where(sys._current_frames()[thread.ident])
    finally:
        event.set()
        thread.join(5)
    assert op == "wait" and site.rsplit(":", 1)[0] == threading.__file__


def _blocked_in_wait(thread: threading.Thread, not_this: object = None) -> FrameType:
    """The thread's innermost frame once it waits inside threading's Condition.wait (a frame other than `not_this`)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == "wait" and frame is not not_this:
            return frame
        time.sleep(0.01)
    raise AssertionError("the thread never waited")


def test_the_watchdog_keeps_no_frame_of_a_call_that_returned():
    """A frame held after its call returned keeps that call's locals alive, and its callers' (a model in its forward,
    free_memory's arguments): the watchdog notes where the watched thread is without holding its frame (under load,
    test_free_memory.py::test_ddp saw the model outlive free_memory when every sample was held)."""
    leave = threading.Event()

    def forward(model: torch.nn.Module) -> None:
        leave.wait(30)

    model = torch.nn.Linear(2, 2)
    probe = weakref.ref(model)
    thread = threading.Thread(target=forward, args=(model,))
    del model
    thread.start()
    _blocked_in_wait(thread)
    watchdog = hang_watch._Watchdog(None, 0, 2, 300.0, thread.ident)
    assert watchdog.look() and watchdog.look()  # the same spot twice, well short of half the timeout
    leave.set()
    thread.join(30)
    gc.collect()
    assert probe() is None


def test_the_watchdog_holds_a_frame_that_stood_still_and_tells_a_new_call_at_its_spot_apart():
    """After half the timeout at one spot the frame is held: a new call of the same code at the same offset (which
    could reuse the address of a returned frame) is progress, not more of the same wait."""
    gate, calls = threading.Semaphore(0), []

    def loop() -> None:
        for _ in range(2):
            calls.append(1)
            gate.acquire(timeout=30)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        first = _blocked_in_wait(thread)
        watchdog = hang_watch._Watchdog(None, 0, 2, 0.2, thread.ident)
        assert watchdog.look() and watchdog.held is None
        time.sleep(0.15)
        assert watchdog.look() and watchdog.held is first
        gate.release()
        second = _blocked_in_wait(thread, not_this=first)
        assert len(calls) == 2 and second.f_code is first.f_code
        del first, second
        since = watchdog.since
        assert watchdog.look() and watchdog.held is None and watchdog.since > since
    finally:
        gate.release()
        thread.join(30)
    assert not watchdog.look()  # the watched thread ended


QUIET = """\
import json, sys, threading
from hf_backend import Accelerator
handlers = []
if sys.argv[1:]:
    from hf_backend.launch.hang_watch import HangWatch
    handlers.append(HangWatch(300))
accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
accelerator.wait_for_everyone()
imported = "hf_backend.launch.hang_watch" in sys.modules
print(json.dumps({"threads": sorted(t.name for t in threading.enumerate()), "imported": imported,
                  "excepthook": getattr(sys.excepthook, "__module__", "")}))  # torch's init_process_group sets its own
"""


@pytest.mark.parametrize("asked", [False, True])
def test_no_watchdog_or_excepthook_unless_asked(tmp_path, asked, monkeypatch):
    """A library inside someone's program (2 processes set up without the launcher) starts no thread, leaves
    sys.excepthook alone and does not even import the hang watch, HF_BACKEND_HANG_TIMEOUT exported or not (the
    launchers read it); a HangWatch passed to the Accelerator asks for both."""
    script = tmp_path / "quiet.py"
    script.write_text(QUIET)
    proc = run_script(script, ["watch"] if asked else [], nproc=2, env={hang_watch.TIMEOUT_VARIABLE: "300"})
    report = json.loads(proc.stdout.splitlines()[1])  # rank 0's line, after "[rank 0]"
    assert ("hf-backend-hang-watchdog" in report["threads"]) == asked, report
    assert report["imported"] == asked, report
    assert (report["excepthook"] == "hf_backend.launch.hang_watch") == asked, report
