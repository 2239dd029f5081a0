"""The manifest a checkpoint carries: every file with its size and checksum, and a checksum of the
metadata itself, written into the metadata once every process has written its part, and verified
before anything is loaded. A damaged or incomplete checkpoint is one line naming the file and what
is wrong, never weights loaded from damaged bytes. `save_state` checkpoints carry one, and so do
hf_backend.Trainer's `checkpoint-{step}` directories (over transformers' files too).

The files' checksum is XXH3-128: it catches what damages checkpoints (truncation, flipped bits, a
torn or replaced file) and runs at memory speed (about 26 GB/s on one core here, against 1.7 GB/s
for SHA-256, which would make verifying a checkpoint slower than reading it). A cryptographic hash
would buy nothing: the manifest is not signed, so whoever can change a file can rewrite the manifest
too (safe_load.py is what keeps a changed file from running code).

Format 3 records a tree of it (`xxh3_128_tree`): the XXH3-128 of the XXH3-128 digests of the file's
64 MiB pieces, in order. Writing costs the same (a writer hashes as it writes); checking splits into
pieces, hashed in threads (xxhash releases the GIL) and, where several processes of one machine load
a checkpoint, divided among them, each process hashing its share once and all seeing every process's
result (so all fail together, with one message). A format-2 manifest's whole-file digest
(`xxh3_128`) is checked whole, one file per job."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..core.errors import HfBackendError
from ..core.notes import note
from ..core.rank import group_size, process_index
from . import layout

# of the metadata's other keys: a changed count or a dropped manifest shows
SELF_CHECKSUM = "metadata_sha256"
DIGEST = "xxh3_128_tree"  # the key of a file's checksum in a manifest entry (format 3)
WHOLE_FILE_DIGEST = "xxh3_128"  # format 2's key: the file hashed whole
# the tree's piece: large enough that a piece's hash costs far more than starting it
PIECE = 64 * 2**20


class TreeDigest:
    """An incremental checksum (`update(bytes)`, `hexdigest()`) of the kind `seal` records: the
    XXH3-128 of the XXH3-128 digests of consecutive `PIECE`-byte pieces."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._piece = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, PIECE - self._filled)
            self._piece.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == PIECE:
                self._pieces.append(self._piece.digest())
                self._piece, self._filled = xxhash.xxh3_128(), 0

    def hexdigest(self) -> str:
        pieces = self._pieces + ([self._piece.digest()] if self._filled else [])
        return combine(pieces)


def new_digest() -> TreeDigest:
    return TreeDigest()


def combine(pieces: list[bytes]) -> str:
    """The tree digest of a file from its pieces' digests."""
    return xxhash.xxh3_128(b"".join(pieces)).hexdigest()


def hash_range(path: Path, start: int = 0, length: int | None = None) -> bytes:
    """The XXH3-128 of `length` bytes of the file from `start` (to its end: None), hashed where they
    lie in the page cache (mapped: about twice the speed of reading them into a buffer, which copies
    every byte first)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        length = size - start if length is None else length
        if not length:
            return xxhash.xxh3_128().digest()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                return xxhash.xxh3_128(view[start:start + length]).digest()
            finally:
                view.release()


def file_digest(path: Path) -> str:
    """A file's tree digest, its pieces hashed in threads."""
    size = path.stat().st_size
    starts = range(0, size, PIECE)
    with ThreadPoolExecutor(_threads(1)) as pool:
        return combine(list(pool.map(lambda start: hash_range(path, start, PIECE), starts)))


def _threads(processes_sharing: int) -> int:
    """Hashing threads for this process: the cores it may use, divided among the processes of its
    machine that hash at the same time."""
    return max(1, len(os.sched_getaffinity(0)) // processes_sharing)


@dataclass(frozen=True)
class Sharing:
    """How the processes of one machine divide a checkpoint's checksums: this process hashes jobs
    `position`, `position + size`, ...; `exchange` hands every process's result (an object) to every
    process (a list, in rank order) together with the machine each came from."""
    position: int
    size: int
    machine: str
    exchange: Callable[[Any], list[Any]]


def machine_sharing() -> Sharing | None:
    """This process's part in checking a checkpoint together with the other processes of its machine
    (None when it is the only process). Every process must call it, and then `verify` with it, at
    the same point."""
    if group_size() == 1:
        return None
    # torch.distributed: only where there are processes to share with
    from ..runtime.collectives import gather_object

    machine = machine_id()
    same = [rank for rank, other in enumerate(gather_object([machine])) if other == machine]
    return Sharing(same.index(process_index()), len(same), machine, gather_object)


def machine_id() -> str:
    """Which machine this process runs on: its host name and the kernel's boot id (host names alone may
    repeat across machines, containers on one machine may differ in host name: both must match)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def metadata_checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of the metadata's keys but the checksum itself, in a canonical form (sorted keys, no
    spaces)."""
    body = {k: v for k, v in meta.items() if k != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(directory: Path, digest: Callable[[Path], str] = file_digest) -> None:
    """Add the manifest of every file under `directory` to its metadata (main process, after all have
    written). A directory without metadata (another process's part, when each process names its own
    directory) has none.
    `digest`: a file's checksum (the writer's, when it hashed the bytes as it wrote them)."""
    meta_path = directory / layout.METADATA
    if not meta_path.is_file():
        return
    meta = json.loads(meta_path.read_text())
    meta["files"] = {str(p.relative_to(directory)): {"size": p.stat().st_size, DIGEST: digest(p)}
                     for p in sorted(directory.rglob("*")) if p.is_file() and p != meta_path}
    meta[SELF_CHECKSUM] = metadata_checksum(meta)
    temporary = meta_path.with_name(meta_path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, meta_path)


def check_metadata(meta_path: Path, meta: dict[str, Any], caller: str = "load_state") -> None:
    """The metadata's own checksum (every sealed checkpoint of format 2 has one)."""
    if meta.get(SELF_CHECKSUM) != metadata_checksum(meta):
        raise HfBackendError(f"{caller}: {meta_path} does not match its checksum (changed since it "
                             "was written); the checkpoint is damaged, use another one")


def verify(directory: Path, files: Any, checksums: bool = True, caller: str = "load_state",
           sharing: Sharing | None = None) -> None:
    """Every file the manifest lists is there with its size (and, with `checksums`, its checksum;
    `sharing`: divided among the processes of this machine, every process then raising the same
    first problem of any). One exception: full model weights (`model.safetensors`, its shards and
    index) that are gone, where weights in that layout were written again in their place
    (transformers' `save_pretrained(max_shard_size=...)` re-sharding a checkpoint's weights, as its
    own tests do), are accepted with a note once the replacement is complete: its index names only
    files that are there, each readable. Their bytes are then not checksummed."""
    if not isinstance(files, dict):
        raise HfBackendError(f"{caller}: {directory / layout.METADATA} has a damaged manifest; use "
                             "another checkpoint")
    weights = {name for name in files if layout.PRETRAINED_WEIGHTS.match(name)}
    resaved = weights and not all((directory / name).exists() for name in weights) and _resaved_weights(directory)
    checked = {name: expected for name, expected in files.items() if not (resaved and name in weights)}
    problems = {name: problem for name, entry in checked.items() if (problem := _problem(directory / name, entry))}
    if checksums:
        problems = _checksum_problems(directory, checked, problems, sharing)
    first = next((name for name in checked if name in problems), None)
    if first is not None:
        raise HfBackendError(f"{caller}: {directory / first} {problems[first]}; the checkpoint is "
                             "damaged, use another one")
    if resaved:
        note(f"{caller}: the weights in {directory} were written again after "
             f"the checkpoint was sealed ({resaved}); they are checked for "
             "completeness, not against the manifest's checksums")


def _resaved_weights(directory: Path) -> str | None:
    """The weights file or index that replaced the sealed weights, when the replacement is complete,
    else None."""
    from safetensors import safe_open

    for index in layout.PRETRAINED_INDEXES:
        path = directory / index
        if not path.is_file():
            continue
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            shards = {str(name) for name in weight_map.values()}
            for shard in shards:
                if Path(shard).name != shard or not (directory / shard).is_file():
                    return None
                if shard.endswith(".safetensors"):
                    with safe_open(directory / shard, "pt") as f:
                        if not {k for k, v in weight_map.items() if v == shard} <= set(f.keys()):
                            return None
        except Exception:  # unreadable: not JSON, no weight_map, a damaged safetensors header
            return None
        return index
    return next((name for name in layout.PRETRAINED_SINGLE if (directory / name).is_file()), None)


def _problem(path: Path, expected: Any) -> str | None:
    """What is wrong with a listed file short of its checksum, or None."""
    if not isinstance(expected, dict) or not ({DIGEST, WHOLE_FILE_DIGEST} & expected.keys()) or "size" not in expected:
        return "has a damaged manifest entry"
    try:
        if path.is_dir():
            return "is a directory where the manifest lists a file"
        if not path.is_file():
            return "is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"has {size} bytes where {expected['size']} were written (truncated or replaced)"
    # a directory on the way that this process may not enter, a file it may not read
    except OSError as err:
        return f"cannot be read ({type(err).__name__})"
    return None


Job = tuple[str, int, "int | None"]  # a file, where its bytes start, how many (None: to the end)


def _checksum_problems(directory: Path, files: dict[str, dict], found: dict[str, str],
                       sharing: Sharing | None) -> dict[str, str]:
    """`found` (problems short of checksums) with each other file's checksum checked against its
    manifest entry: the jobs (a tree digest's pieces, a format-2 file whole) are hashed in threads,
    this process's share of them where `sharing`. Then the problems of this machine, or where it has
    none, those of the first machine that has any: no process goes on to load what another refused.
    """
    position, size = (sharing.position, sharing.size) if sharing else (0, 1)

    def run(job: Job) -> tuple[tuple[str, int], bytes | str]:
        name, start, length = job
        try:
            return (name, start), hash_range(directory / name, start, length)
        except OSError as err:
            return (name, start), f"cannot be read ({type(err).__name__})"

    with ThreadPoolExecutor(_threads(size)) as pool:
        done = dict(pool.map(run, _jobs(files, found)[position::size]))
    if sharing is None:
        return {**found, **_compare(files, found, done)}
    machines: dict[str, tuple[dict, dict]] = {}
    for machine, found_there, done_there in sharing.exchange((sharing.machine, found, done)):
        known, hashed = machines.setdefault(machine, ({}, {}))
        known.update(found_there)
        hashed.update(done_there)
    outcome = {machine: {**known, **_compare(files, known, hashed)}
               for machine, (known, hashed) in machines.items()}
    return outcome[sharing.machine] or next((problems for problems in outcome.values() if problems), {})


def _jobs(files: dict[str, dict], found: dict[str, str]) -> list[Job]:
    return [(name, start, PIECE if DIGEST in entry else None)
            for name, entry in sorted(files.items()) if name not in found
            for start in (range(0, entry["size"], PIECE) if DIGEST in entry else (0,))]


def _compare(files: dict[str, dict], found: dict[str, str], done: dict[tuple[str, int], bytes | str]) -> dict[str, str]:
    """Each file `found` has no problem for, from its jobs' hashes, against its manifest entry."""
    parts: dict[str, list[bytes | str]] = {name: [] for name in files if name not in found}
    for name, start, _ in _jobs(files, found):
        parts[name].append(done[(name, start)])
    problems = {}
    for name, hashed in parts.items():
        failed = next((h for h in hashed if isinstance(h, str)), None)
        pieces = [h for h in hashed if isinstance(h, bytes)]  # all of them when none failed
        tree = files[name].get(DIGEST)
        if failed:
            problems[name] = failed
        elif (combine(pieces) != tree) if tree is not None else (pieces[0].hex() != files[name][WHOLE_FILE_DIGEST]):
            problems[name] = "does not match its checksum (changed since it was written)"
    return problems
