"""Hangs that name their rank.

A process-group plugin (`HangWatch`), run only where it is installed: `hf-backend launch` and
`notebook_launcher` install it in their workers (`HF_BACKEND_HANG_TIMEOUT` seconds, which
`hf-backend launch` sets: 300 unless told otherwise); under plain `torchrun` a script passes it,
`Accelerator(kwargs_handlers=[HangWatch(timeout=300)])` or
`hf_backend.add_process_group_plugin(HangWatch(timeout=300))` (with a Trainer). Nothing else in
hf_backend imports this module. A watchdog thread, started when the process group is set up, watches
the thread that set it up: when its innermost Python frame has not moved for that long, the rank
records in the process group's store where it waits. When every rank waits (or has exited), each
prints the stacks of its threads, they all record one line naming every rank and where it waits, and
exit: never a silent hang until the process group's timeout. Nothing is added to a collective: the
thread samples a frame once a second and touches the store only while its rank stands still.

Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks every collective's kind and shapes across ranks
and raises on a mismatch; `explain` turns that error into one line naming each rank's operation and
call site, which the ranks exchange through the store (torch's message has no Python call sites).
torch does not always raise on every rank (a monitored barrier raises on the rank that waited; a
check now and then only on one side): a rank that got no error is answered for by its watchdog, with
where it stands still.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from ..core.errors import HfBackendError
from .worker_failures import record_failure

TIMEOUT_VARIABLE = "HF_BACKEND_HANG_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # what hf-backend launch sets
EXCHANGE_SECONDS = 5.0  # how long a rank that hit a mismatch waits for its peers' call sites
# how long a peer's watchdog answer waits for that peer's own mismatch record to win over it
ANSWER_GRACE = 0.5
# set while this rank reports a hang; the process then ends by the watchdog's hand
reporting = threading.Event()
# set while this rank exchanges its own mismatch record: its watchdog does not answer
_explaining = threading.Event()
_watchdog: _Watchdog | None = None


@dataclass(frozen=True)
class HangWatch:
    """The hang watch, as a process-group plugin (hf_backend.state.add_process_group_plugin).

    Args:
        timeout: seconds without progress on every rank before the job is reported as hung (0: off).
        reported_by_launcher: the launcher prints the one-line summary itself (`hf-backend launch`'s workers).
    """

    timeout: float = DEFAULT_TIMEOUT
    reported_by_launcher: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout >= 0:
            raise HfBackendError(_BAD_TIMEOUT.format(name="HangWatch(timeout)", raw=repr(self.timeout)))

    @classmethod
    def install_from_environment(cls, reported_by_launcher: bool = False) -> None:
        """What a launcher's worker does: run the watch `HF_BACKEND_HANG_TIMEOUT` asks for (none when
        it is unset or
        0) beside this process's group."""
        from ..runtime.process import add_process_group_plugin

        seconds = hang_timeout()
        if seconds > 0:
            add_process_group_plugin(cls(seconds, reported_by_launcher))

    def start(self, group_timeout: datetime.timedelta | None = None) -> None:
        if self.timeout > 0:
            _start(self, group_timeout)

    def stop(self) -> None:
        stop(exited=True)


_BAD_TIMEOUT = "{name}={raw} is not a number of seconds >= 0; set e.g. 300, or 0 to turn the hang watchdog off"


def hang_timeout() -> float:
    """Seconds without progress on every rank before the job is reported as hung; 0 (or unset) turns
    the watchdog off."""
    raw = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise HfBackendError(_BAD_TIMEOUT.format(name="environment variable "
                                                      f"{TIMEOUT_VARIABLE}", raw=repr(raw)))
    return value


def _start(watch: HangWatch, group_timeout: datetime.timedelta | None) -> None:
    """Start the watchdog for this process's default process group (once), and the one-line account of
    collective mismatches when TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    global _watchdog
    import torch.distributed as dist

    if _watchdog is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    seconds = watch.timeout
    _install_excepthook(watch.reported_by_launcher)
    from ..core.notes import warn

    limit = (group_timeout or dist.constants.default_pg_timeout).total_seconds()
    if seconds >= limit:
        warn(f"the hang timeout ({seconds:g} s) is not below the process group's timeout "
             f"({limit:g} s): a hung collective times out first, without the ranks' stacks; lower "
             "it, or raise the group's timeout")
    try:
        store = _store()
    # a group set up without a store: nothing to share waits through
    except (RuntimeError, ValueError):
        return
    _watchdog = _Watchdog(store, dist.get_rank(), dist.get_world_size(), seconds, threading.get_ident(),
                          watch.reported_by_launcher)
    _watchdog.thread = threading.Thread(target=_watchdog.run, name="hf-backend-hang-watchdog", daemon=True)
    _watchdog.thread.start()
    atexit.register(stop, exited=True)


def stop(exited: bool = False) -> None:
    """Stop the watchdog; `exited`: record that this rank has finished, so that peers left waiting say
    so."""
    global _watchdog
    watchdog, _watchdog = _watchdog, None
    if watchdog is not None:
        watchdog.stopped.set()
        if watchdog.thread is not None and watchdog.thread is not threading.current_thread():
            # Ended before the group is destroyed and the interpreter finalizes: a daemon thread
            # still running then can be stopped inside torch's C++ code, and the process aborts
            # ("terminate called without an active exception"), failing a run that had finished.
            watchdog.thread.join(timeout=5)
        if exited:
            watchdog.publish({"state": "exited"})


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _key(kind: str, rank: int | str) -> str:
    # A restarted group (--max_restarts) must not read the records of the attempt before.
    return f"hf_backend/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{kind}/{rank}"


class _Watchdog:
    def __init__(self, store: Any, rank: int, world: int, timeout: float, thread_id: int,
                 reported_by_launcher: bool = False) -> None:
        self.store, self.rank, self.world, self.timeout, self.thread_id = store, rank, world, timeout, thread_id
        self.reported_by_launcher = reported_by_launcher
        self.stopped = threading.Event()
        self.published = False
        self.answered = False
        self.thread: threading.Thread | None = None
        # Where the watched thread was: its innermost frame's identity, code and offset, and since
        # when. The frame itself is held only once it has stood still for half the timeout: a frame
        # held after its call returned keeps that call's locals (and its callers', through f_back)
        # alive, and a model freed just then (its forward, free_memory's arguments) would outlive
        # the gc.collect that should free it.
        self.spot: tuple | None = None
        self.held: FrameType | None = None
        self.since = time.monotonic()

    def publish(self, record: dict | None) -> None:
        """This rank's record (None: it moves again). Store errors mean the job is going away: nothing
        to report."""
        try:
            if record is None:
                self.store.delete_key(_key("wait", self.rank))
            else:
                self.store.set(_key("wait", self.rank), json.dumps(record))
            self.published = record is not None
        except Exception:  # noqa: BLE001 - the store's host (the launcher, rank 0) is gone
            self.stopped.set()

    def run(self) -> None:
        import torch.distributed as dist

        interval = min(1.0, self.timeout / 10)
        try:
            while not self.stopped.wait(interval):
                if not dist.is_initialized() or not self.look():
                    return  # the group was destroyed, or the watched thread ended
        finally:
            self.held = None

    def look(self) -> bool:
        """Sample the watched thread once (False: it ended); report a hang once every rank has stood
        still for the timeout. Holds no frame when it returns, but one that has stood still for half
        the timeout."""
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return False
        spot = (id(frame), frame.f_code, frame.f_lasti)
        # A new call can reuse a returned frame's address: the same spot is the same frame only
        # while it is held.
        if spot != self.spot or (self.held is not None and frame is not self.held):
            self.spot, self.held, self.since = spot, None, time.monotonic()
            if self.published:
                self.publish(None)
            return True
        waited = time.monotonic() - self.since
        self._answer(frame)
        if self.held is None:
            if waited >= self.timeout / 2:
                # from here on, a call that returned and a new one at its address are told apart
                self.held = frame
            return True
        if waited < self.timeout:
            return True
        if not self.published:
            op, site = where(frame)
            self.publish({"state": "waiting", "op": op, "site": site})
        records = self._records()
        if records is not None and not self.stopped.is_set():
            self._report(records, frame, waited)
        return True

    def _answer(self, frame: FrameType) -> None:
        """A peer that hit a collective mismatch (or a monitored barrier that gave up on this rank)
        asks every rank where it is; one that got no error itself answers once, with where it stands
        still."""
        if self.answered or _explaining.is_set():
            return
        try:
            if not self.store.check([_key("mismatch", "asked")]):
                return
            op, site = where(frame)
            self.store.set(_key("answer", self.rank), json.dumps({"state": "waiting", "op": op, "site": site}))
        except Exception:  # noqa: BLE001 - the store's host is gone
            pass
        self.answered = True

    def _stacks(self) -> str:
        """Every thread's stack but this watchdog's, the watched thread first, each line prefixed as
        torch prefixes a rank's traceback."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        frames = sys._current_frames()
        frames.pop(threading.get_ident(), None)
        lines = []
        for ident in sorted(frames, key=lambda ident: ident != self.thread_id):
            watched = " (it set up the process group)" if ident == self.thread_id else ""
            lines.append(f"Thread {names.get(ident, ident)}{watched}, most recent call last:\n")
            lines.extend(traceback.format_stack(frames[ident]))
        return "".join(f"[rank{self.rank}]: {line}\n" for chunk in lines for line in chunk.rstrip("\n").split("\n"))

    def _records(self) -> list[dict] | None:
        """Every rank's record when each has one (all wait or exited), else None."""
        keys = [_key("wait", rank) for rank in range(self.world)]
        try:
            if not self.store.check(keys):
                return None
            return [json.loads(value) for value in self.store.multi_get(keys)]
        except Exception:  # noqa: BLE001 - the store's host is gone
            return None

    def _report(self, records: list[dict], frame: FrameType, waited: float) -> None:
        # from here, the main thread's error from a peer that already exited is not news
        reporting.set()
        waiting = [rank for rank, record in enumerate(records) if record["state"] == "waiting"]
        summary = hang_summary(records, self.timeout)
        op, site = where(frame)
        sys.stdout.flush()
        sys.stderr.flush()
        text = (f"hf_backend: rank {self.rank} has waited {waited:.0f} s in {op} at {site}; the "
                f"stacks of its threads:\n{self._stacks()}")
        data = text.encode(errors="replace")
        while data:  # whole writes: the ranks' stacks do not interleave line by line
            data = data[os.write(sys.stderr.fileno(), data):]
        # No rank exits (and has the launcher stop the others) before every waiting rank has printed
        # its stacks.
        done = [_key("stacks", rank) for rank in waiting]
        try:
            self.store.set(_key("stacks", self.rank), "1")
            deadline = time.monotonic() + 2 * min(1.0, self.timeout / 10) + 5
            while not self.store.check(done) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host is gone
            pass
        record_failure(f"HangError: {summary}", summary, "".join(_format_stack(frame)))
        if self.rank == waiting[0]:
            if not self.reported_by_launcher:
                print(f"hf_backend: {summary}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # the store's host is gone
                self.store.set(_key("summary", self.rank), "1")
        # the first rank to exit has the launcher stop the others: not before the summary is out
        else:
            with contextlib.suppress(Exception):
                deadline = time.monotonic() + 5
                while not self.store.check([_key("summary", waiting[0])]) and time.monotonic() < deadline:
                    time.sleep(0.05)
        os._exit(1)


def hang_summary(records: list[dict], timeout: float) -> str:
    """One line: every rank, where it waits or that it exited."""
    parts = [f"rank {rank} waiting in {record['op']} at {record['site']}" if record["state"] == "waiting"
             else f"rank {rank} exited" for rank, record in enumerate(records)]
    return f"hang: no rank made progress for {timeout:g} s: {'; '.join(parts)}"


# -- where a rank is: its operation and its call site ----------------------------------------------
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every library root: torch, hf_backend, the standard library, installed packages; torch and
    hf_backend)."""
    import torch

    paths = sysconfig.get_paths()
    ours = {os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # hf_backend/
    every = ours | {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return tuple(os.path.join(os.path.realpath(root), "") for root in every), \
        tuple(os.path.join(os.path.realpath(root), "") for root in ours)


def _frames(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def where(frame: FrameType) -> tuple[str, str]:
    """(operation, call site) of the stack whose innermost frame is `frame`: the outermost
    torch.distributed collective on it (backward, for DDP's all-reduce inside autograd; else the
    innermost function), and the innermost frame of the user's own code (not torch, hf_backend, the
    standard library or installed packages)."""
    frames = _frames(frame)
    files = [f.f_code.co_filename.replace(os.sep, "/") for f in frames]
    c10d = [f.f_code.co_name for f, name in zip(frames, files) if name.endswith("/distributed/distributed_c10d.py")]
    if c10d:
        op = c10d[-1]
    elif any("torch/autograd/" in name for name in files):
        op = "backward"
    else:
        op = frames[0].f_code.co_name
    every, ours = _library_roots()
    real = [f.f_code.co_filename if f.f_code.co_filename.startswith("<") else os.path.realpath(f.f_code.co_filename)
            for f in frames]
    user = [f for f, name in zip(frames, real) if not name.startswith(every) and not name.startswith("<")]
    # A script installed as a package: the innermost frame outside torch and hf_backend.
    user = user or [f for f, name in zip(frames, real) if not name.startswith(ours) and not name.startswith("<")]
    chosen = user[0] if user else frames[0]
    name = chosen.f_code.co_filename
    relative = os.path.relpath(name) if os.path.isabs(name) else name
    shown = relative if not relative.startswith("..") else name
    return op, f"{shown}:{chosen.f_lineno}"


def _format_stack(frame: FrameType) -> str:
    return "".join(traceback.format_stack(frame))


# -- TORCH_DISTRIBUTED_DEBUG=DETAIL: one line for a collective mismatch ----------------------------
_OWN = r"Rank {rank} is running collective: CollectiveFingerPrint\((?P<print>.*?)(?:\), but Rank|\)\.|\)$)"
_PEER = re.compile(r"but Rank (\d+) is running collective")
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def explain(error: BaseException) -> str | None:
    """For torch's collective-mismatch error (TORCH_DISTRIBUTED_DEBUG=DETAIL): one line naming each
    rank involved, its operation and its call site, exchanged with the peers through the store (each
    waits up to EXCHANGE_SECONDS); None for any other error. Computed once per error."""
    cached = getattr(error, "_hf_backend_summary", None)
    if cached is not None:
        return cached or None
    text = str(error)
    line = None
    if "Detected mismatch between collectives" in text or "failed to pass monitoredBarrier" in text:
        try:
            line = _explain(text, error.__traceback__)
        except Exception:  # noqa: BLE001 - no process group or store any more: torch's own message stands
            line = None
    try:
        error._hf_backend_summary = line or ""  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return line


def _explain(text: str, tb: TracebackType | None) -> str | None:
    import torch.distributed as dist

    if not dist.is_initialized() or tb is None:
        return None
    _explaining.set()
    rank = dist.get_rank()
    while tb.tb_next is not None:
        tb = tb.tb_next
    op, site = where(tb.tb_frame)
    own = re.search(_OWN.format(rank=rank), text, re.S)
    detail = _fingerprint(own.group("print")) if own else ""
    peers = {int(r) for r in _PEER.findall(text)}
    missing = _MISSING.search(text)
    if missing:
        peers |= {int(r) for r in missing.group(1).replace(" ", "").split(",") if r}
    store = _store()
    store.set(_key("mismatch", rank), json.dumps({"op": op, "detail": detail, "site": site}))
    store.set(_key("mismatch", "asked"), "1")
    records = {rank: {"op": op, "detail": detail, "site": site}}
    deadline = time.monotonic() + EXCHANGE_SECONDS
    pending = set(peers) - {rank}
    answered: dict[int, float] = {}  # when a peer's watchdog answer was first seen
    while pending:
        now = time.monotonic()
        for peer in sorted(pending):
            record = _read(store, "mismatch", peer)  # the peer's own error
            if record is None:
                record = _read(store, "wait", peer)
                record = record if record and record["state"] == "exited" else None
            # A watchdog's answer counts after ANSWER_GRACE: a peer that raised an instant after its
            # watchdog answered has its own record win.
            if record is None and store.check([_key("answer", peer)]) and (
                    now - answered.setdefault(peer, now) >= ANSWER_GRACE or now >= deadline):
                record = _read(store, "answer", peer)
            if record is not None:
                records[peer] = record
                pending.discard(peer)
        if now >= deadline:
            break
        if pending:
            time.sleep(0.05)
    parts = []
    for peer in sorted(records.keys() | pending):
        record = records.get(peer)
        if record is None:
            parts.append(f"rank {peer} in no collective (it did "
                         f"not answer in {EXCHANGE_SECONDS:g} s)")
        elif record.get("state") == "exited":
            parts.append(f"rank {peer} exited")
        elif record.get("state") == "waiting":
            parts.append(f"rank {peer} waiting in {record['op']} at {record['site']}")
        else:
            same = record["detail"].replace("_", "").lower() == record["op"].replace("_", "").lower()
            shape = f" ({record['detail']})" if record["detail"] and not same else ""
            parts.append(f"rank {peer} calls {record['op']}{shape} at {record['site']}")
    return "collective mismatch: " + "; ".join(parts)


def _read(store: Any, kind: str, rank: int) -> dict | None:
    return json.loads(store.get(_key(kind, rank))) if store.check([_key(kind, rank)]) else None


def _fingerprint(raw: str) -> str:
    """torch's 'SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[3], TensorDtypes=Float, ...' as
    'ALLREDUCE of Float[3]'; a collective without tensors (a barrier) as its type alone."""
    kind, shape, dtype = (re.search(pattern, raw) for pattern in (r"OpType=(\w+)", r"TensorShape=(\[[^\]]*\])",
                                                                  r"TensorDtypes=(\w+)"))
    out = kind.group(1) if kind else ""
    if shape or dtype:
        out += f" of {dtype.group(1) if dtype else ''}{shape.group(1) if shape else ''}"
    return out


def await_exit() -> None:
    """Called with an error while this rank reports a hang: the error is only a peer that finished its
    report and exited before this one; wait for the watchdog to end the process instead of printing
    it."""
    if reporting.is_set():
        time.sleep(60)


_HOOKED: list[bool] = []


def printing_rank(line: str) -> int | None:
    """Which rank prints a mismatch's line under plain torchrun: the lowest rank that torch raised on
    ("calls"), so that a line is printed once even when the lowest rank named got no error ("waiting
    in", "did not answer")."""
    raised = [int(rank) for rank in re.findall(r"rank (\d+) calls ", line)]
    return min(raised) if raised else None


def _print_once(line: str, rank: int) -> None:
    """The printing rank prints `line` and says so in the store; any other rank waits for that (up to
    EXCHANGE_SECONDS) before it exits, since its exit makes torchrun stop the printing rank, which may
    not have printed yet."""
    printer, printed = printing_rank(line), _key("mismatch", "printed")
    try:
        if rank == printer:
            print(f"hf_backend: {line}", file=sys.stderr, flush=True)
            _store().set(printed, "1")
            return
        deadline = time.monotonic() + EXCHANGE_SECONDS
        while printer is not None and time.monotonic() < deadline and not _store().check([printed]):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went with the job: nothing left to wait for
        pass


def _install_excepthook(reported_by_launcher: bool) -> None:
    """Plain torchrun: one rank (`printing_rank`) prints a mismatch's one line before the traceback.
    After a mismatch the process exits at once: tearing down a group left with failed work takes
    gloo about 4 s, which only delays the report. While a hang is reported, an error is not printed
    (`await_exit`)."""
    if _HOOKED:
        return
    _HOOKED.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        await_exit()
        line = explain(error)
        if line and not reported_by_launcher:
            import torch.distributed as dist

            if dist.is_initialized():
                _print_once(line, dist.get_rank())
        previous(kind, error, tb)
        if line:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = hook
