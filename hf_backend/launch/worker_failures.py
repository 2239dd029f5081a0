"""What a failed worker leaves for its launcher, and the one line the launcher makes of it.

A worker writes the error file torch elastic gives it (`TORCHELASTIC_ERROR_FILE`, the format of its
`@record`) with the exact time, and for a hang or a collective mismatch the one line naming every
rank (hf_backend/launch/hang_watch.py); the launcher (`hf-backend launch`, `notebook_launcher`) then names
the rank that failed first, not one that only lost its peer.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any


def record_error(error: BaseException, summary: str | None = None) -> None:
    """Record `error`, raised in this worker, for the launcher (`summary`: the line naming every rank,
    if any)."""
    record_failure(f"{type(error).__name__}: {error}", summary, traceback.format_exc())


def record_failure(message: str, summary: str | None, stack: str) -> None:
    """Write torch elastic's error file for this worker, as its `@record` does (the launcher reads
    `summary`, when there is one, from it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    info = {"py_callstack": stack, "timestamp": str(int(now)), "time": now, **({"summary": summary} if summary else {})}
    data = {"message": {"message": message, "extraInfo": info}}
    # Whole or not at all: the launcher stops the other workers once one fails (SIGTERM, then SIGKILL) and then reads
    # every error file there is; one cut off mid-write was empty, and torch elastic's json.load of it ended the launch.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        pass


def describe_failure(err: Any) -> str:
    """One line: which rank failed first, how, and its error's message (all its lines, joined and
    bounded); for a hang or a collective mismatch, the workers' own line naming every rank and where
    it is."""
    rank, failure = min(err.failures.items(), key=lambda item: _failure_time(item[1]))
    recorded = _failure_time(failure) != float("inf")
    summary = _summary(failure)
    if summary:
        stacks = "; every rank's stacks are above" if summary.startswith("hang:") else ""
        return f"{summary}{stacks}; the workers were stopped"
    if failure.exitcode >= 0:
        how = f"exited with code {failure.exitcode}"
    elif recorded:  # it raised, then the launcher stopped it before it had exited
        how = "failed"
    else:
        how = f"was killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = one_line(str(message or ""))
    detail = f": {text}" if text and (recorded or failure.exitcode >= 0) else ""
    return f"rank {rank} (local rank {failure.local_rank}) {how}{detail}; the other workers were stopped"


def _summary(failure: Any) -> str | None:
    """The line a worker recorded for a hang or a collective mismatch (hf_backend/launch/hang_watch.py), if
    any."""
    message = failure.message
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("summary") or None
    return None


def one_line(message: str, limit: int = 300) -> str:
    """A multi-line message on one line, bounded: a pydantic error's key is on its second line, a URL
    on its last."""
    text = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def _failure_time(failure: Any) -> float:
    """When the worker failed: the exact time our worker recorded, else the whole seconds of torch's
    record; no record (a worker killed by the launcher, whose "timestamp" is merely when torch
    looked), last."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    if isinstance(message, dict):
        return float(message.get("extraInfo", {}).get("time", failure.timestamp))
    return float(failure.timestamp) if "timestamp" in data else float("inf")
