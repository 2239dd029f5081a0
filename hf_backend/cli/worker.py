"""What each process started by `hf-backend launch` runs: the user's script or module, as `python` would.

An exception is written to the error file torch elastic gives each worker (its format, plus the exact time), so the
launcher can name the rank that failed first, and its error, instead of a rank that only lost its peer.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback


def _record(error: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(now)),
                                      "time": now}}}
    with open(path, "w") as f:
        json.dump(data, f)


def main() -> None:
    argv = sys.argv[1:]
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
        if stop.code not in (0, None):
            _record(stop)
        raise
    except KeyboardInterrupt:  # the launcher passes on its SIGINT to stop the workers; it says so in one line
        sys.exit(128 + signal.SIGINT)
    except BaseException as error:
        _record(error)
        raise


if __name__ == "__main__":
    main()
