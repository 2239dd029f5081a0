"""What each process started by `hf-backend launch` runs: the user's script or module, as `python`
would.

An exception is written to the error file torch elastic gives each worker (its format, plus the
exact time), so the launcher can name the rank that failed first, and its error, instead of a rank
that only lost its peer.

A worker dies with its launcher (`--parent PID`, the launcher's pid): if the launcher is SIGKILLed
it cannot stop its workers, so each asks the kernel for a SIGKILL when its parent dies (Linux), or
polls its parent (elsewhere).

Its interpreter ends without the final full garbage collection (`end_without_final_collection`).
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import sys
import threading
import time

from ..launch import hang_watch
from ..launch.worker_failures import record_error

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` exits: a parent-death signal on Linux, a watchdog thread
    elsewhere."""
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGKILL):
        if os.getppid() != parent:  # it died before the signal was set
            _kill_self()
        return
    threading.Thread(target=_watch_parent, args=(parent,), name="hf-backend-parent-watchdog", daemon=True).start()


def _set_parent_death_signal(sig: int) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    _kill_self()


def _kill_self() -> None:
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def end_without_final_collection() -> None:
    """Freeze the heap once every other atexit function has run (registered first, it runs last), so that the
    interpreter's shutdown skips its full collection: with transformers and peft imported that pass walks millions of
    objects, about 1.5 s of CPU per process (0.2 s frozen). What is freed by reference counting still is (files
    flush and close); cyclic garbage left at exit keeps no `__del__` promise (Python's data model makes none).
    Only for processes hf_backend runs as a program: a worker and the command line, never on import."""
    atexit.register(gc.freeze)


def main() -> None:
    end_without_final_collection()
    hang_watch.HangWatch.install_from_environment(reported_by_launcher=True)
    argv = sys.argv[1:]
    if argv[:1] == ["--parent"]:
        die_with_parent(int(argv[1]))
        argv = argv[2:]
    try:
        if argv and argv[0] == "--module":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        hang_watch.await_exit()
        if stop.code not in (0, None):
            record_error(stop, hang_watch.explain(stop))
        raise
    # the launcher passes on its SIGINT to stop the workers; it says so in one line
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
    except BaseException as error:
        hang_watch.await_exit()  # reporting a hang: a peer's exit is not this rank's failure
        record_error(error, hang_watch.explain(error))  # a mismatch: the line naming each rank
        raise


if __name__ == "__main__":
    main()
