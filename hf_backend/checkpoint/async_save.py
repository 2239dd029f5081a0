"""Where one save's bytes go: written now, or staged in host memory and written in the background.

`Writes` is handed to `CheckpointIO.write`: the large states (full weights, full optimizer states,
DCP shards) go through it, everything small is written at once. A synchronous save runs each write
as it comes. An async save (`save_state(async_save=True)`) first copies each state to host memory
(`snapshot`; shards through DCP's own stager), so that training may change the live tensors as soon
as `save_state` returns, then writes on one thread.

Which thread calls collectives: the writer thread writes and hashes bytes, and runs `dcp.save` for
shards, which does run collectives (its save plan and metadata). Those go to a gloo group of their
own, made once on the main thread (`CheckpointIO.save_group`), never the group training's
collectives use: two threads issuing collectives concurrently on one group can pair one rank's
barrier with another rank's all-reduce. For the same reason the DCP directories (model, optimizer)
are saved one after another on the one writer thread, not by one `dcp.async_save` thread each.
Everything else that needs every process (the barrier saying all ranks are done, the manifest, the
renames, fsync, rotation) runs on the main thread in `PendingSave.finish`, called by the next save,
`load_state`, `wait_for_checkpoint`, `end_training` or `free_memory`, which every process calls in
the same order, like any other collective. Until then the checkpoint is `<dir>.incomplete`, which
nothing loads; a failed write removes it and raises one line at that call.
"""

from __future__ import annotations

import atexit
import copy
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from ..core.errors import HfBackendError
from ..core.nested import recursively_apply
from ..core.notes import note
from ..runtime.collectives import gather_object
from . import durable
from .directories import Staging


class Writes:
    """The large writes of one save: run now (`background=False`), or queued and run by `start()` on a
    thread."""

    def __init__(self, background: bool = False, group: Any = None) -> None:
        self.background = background
        # the gloo group of the writer thread's dcp.save (None: one process, or a synchronous save)
        self.group = group
        self.jobs: list[Callable[[], durable.Digests]] = []
        self.sharded: list[Path] = []
        self.digests: durable.Digests = {}
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def snapshot(self, state: Any) -> Any:
        """`state` itself for a synchronous save; for an async one, a copy in host memory that later
        training steps do not touch (tensors viewing the same memory, tied weights, stay one copy).
        """
        return _host_copy(state) if self.background else state

    def file(self, job: Callable[[], durable.Digests]) -> None:
        """`job()` writes files of snapshotted state and returns their digests."""
        if self.background:
            self.jobs.append(job)
        else:
            self.digests.update(job())

    def shards(self, state_dict: dict[str, Any], directory: Path) -> None:
        """Each process's shards into the DCP directory `directory` (every process calls this). In the
        background: staged by DCP's own stager now, then `dcp.save` on the writer thread, one
        directory after another (what `dcp.async_save` does, except that its one thread per call
        would run two saves' collectives concurrently on one group, and ranks can pair them
        differently: a deadlock)."""
        if self.background:
            staged = BlockingAsyncStager().stage(state_dict)
            self.sharded.append(directory)

            def save() -> durable.Digests:
                dcp.save(staged, checkpoint_id=str(directory), process_group=self.group)
                return {}

            self.jobs.append(save)
        else:
            dcp.save(state_dict, checkpoint_id=str(directory))
            self.sharded.append(directory)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="hf_backend-async-save", daemon=False)
        self.thread.start()

    def _run(self) -> None:
        try:
            for job in self.jobs:
                self.digests.update(job())
            self.jobs.clear()  # drops the snapshots as soon as they are written
            # complete: DCP's save returns once every rank's files are written
            for directory in self.sharded:
                # DCP fsyncs its files; hash them here, not in seal
                self.digests.update(durable.hash_tree(directory))
        except BaseException as err:  # noqa: BLE001 - reported on the main thread by finish()
            self.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")

    def join(self) -> str | None:
        """Wait for the background writes; this process's error as one line, or None."""
        if self.thread is not None:
            self.thread.join()
        return self.error

    def digest(self, path: Path) -> str:
        """The checksum of a file this save wrote (hashed while writing), or hashed now."""
        known = self.digests.get(path)
        if known is not None and known[0] == path.stat().st_size:
            return known[1]
        from .manifest import file_digest

        return file_digest(path)


class PendingSave:
    """A save whose writes are done or under way; `finish()` (every process) seals and renames it, or
    cleans up.
    `staging`: a directories.Staging (a Trainer checkpoint's:
    hf_backend/trainer/async_checkpoint.py)."""

    def __init__(self, staging: Staging, writes: Writes, seal: Callable[[Path, Callable[[Path], str]], None],
                 after: Callable[[], None] | None) -> None:
        self.staging, self.writes, self.seal, self.after = staging, writes, seal, after

    def finish(self) -> Path:
        # every rank's outcome, on the main thread
        errors = [e for e in gather_object([self.writes.join()]) if e]
        if errors:
            self.staging.abandon()
            raise HfBackendError(f"async save of {self.staging.target} failed ({errors[0]}); no "
                                 "checkpoint was written there: fix the cause (disk space, "
                                 "permissions) and save again")
        self.staging.commit(lambda directory: self.seal(directory, self.writes.digest))
        if self.after is not None:
            self.after()
        return self.staging.target


class AsyncSaves:
    """The one save of a CheckpointIO that may still be under way. A process that exits without
    `wait()` (no `end_training`) finishes it at exit when it is alone; with several processes that
    would need a collective at exit, so the bytes are written but the checkpoint stays
    `.incomplete`, with a note."""

    def __init__(self) -> None:
        self.pending: PendingSave | None = None

    def put(self, pending: PendingSave) -> None:
        _finish_at_exit_once(self)
        pending.writes.start()
        self.pending = pending

    def wait(self) -> Path | None:
        """Finish the pending save, if any (every process); its failure raises here, once."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    def at_exit(self) -> None:
        pending = self.pending
        if pending is None:
            return
        if pending.staging.process.distributed:
            pending.writes.join()
            note(f"exiting with the async save of {pending.staging.target} unfinished: call "
                 "accelerator.end_training() or wait_for_checkpoint() before exiting; its files "
                 f"stay in {pending.staging.path}")
            return
        try:
            self.wait()
        except HfBackendError as err:
            note(str(err))


# those that have put an async save (AsyncSaves.put)
_LIVE: weakref.WeakSet[AsyncSaves] = weakref.WeakSet()
_HOOKED = False


def _finish_at_exit_once(saves: AsyncSaves) -> None:
    """Finish `saves` at exit (AsyncSaves.at_exit): the exit hook is registered with the first async
    save, never on import or for synchronous saves."""
    global _HOOKED
    if not _HOOKED:
        atexit.register(_finish_at_exit)
        _HOOKED = True
    _LIVE.add(saves)


def _finish_at_exit() -> None:
    for saves in list(_LIVE):
        saves.at_exit()


def _host_copy(state: Any) -> Any:
    """`state` with every tensor copied to host memory (tensors sharing memory stay shared) and every
    other value deep-copied: a snapshot that training can no longer change."""
    memo: dict[Any, torch.Tensor] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()) \
            if tensor.numel() else id(tensor)
        if key not in memo:
            memo[key] = tensor.detach().to("cpu", copy=True)
        return memo[key]

    return recursively_apply(copy_tensor, state, copy.deepcopy)
