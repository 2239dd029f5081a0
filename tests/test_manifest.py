"""The manifest's checksums (hf_backend/checkpoint/manifest.py): format 3's piecewise tree digest, hashed in threads
and divided among the processes of a machine; format 2's whole-file digests still read."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash
from helpers import run_script

from hf_backend import Accelerator, HfBackendError
from hf_backend.checkpoint import layout, manifest

PIECE = 2**20


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(manifest, "PIECE", PIECE)


@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, 3 * PIECE + 7])
def test_the_tree_digest_is_the_same_written_in_any_chunks_and_hashed_in_threads(tmp_path, small_pieces, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    written = manifest.new_digest()
    for start in range(0, size, 300_007):  # chunks that straddle the pieces' boundaries
        written.update(data[start:start + 300_007])
    pieces = [xxhash.xxh3_128(data[s:s + PIECE]).digest() for s in range(0, size, PIECE)]
    assert written.hexdigest() == manifest.file_digest(tmp_path / "f") == manifest.combine(pieces)


@pytest.mark.parametrize("where", [0, PIECE, 3 * PIECE + 6])
def test_a_flipped_byte_in_any_piece_is_found(tmp_path, small_pieces, where):
    data = bytearray(os.urandom(3 * PIECE + 7))
    (tmp_path / "f").write_bytes(data)
    files = {"f": {"size": len(data), manifest.DIGEST: manifest.file_digest(tmp_path / "f")}}
    manifest.verify(tmp_path, files)
    data[where] ^= 1
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(HfBackendError, match=r"/f does not match its checksum"):
        manifest.verify(tmp_path, files)


def _as_format_2(directory) -> None:
    """The checkpoint as an hf_backend of format 2 wrote it: each file's XXH3-128 whole."""
    meta_path = directory / layout.METADATA
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 2
    meta["files"] = {name: {"size": entry["size"],
                            manifest.WHOLE_FILE_DIGEST: xxhash.xxh3_128((directory / name).read_bytes()).hexdigest()}
                     for name, entry in meta["files"].items()}
    meta[manifest.SELF_CHECKSUM] = manifest.metadata_checksum(meta)
    meta_path.write_text(json.dumps(meta))


def test_a_format_2_checkpoint_still_loads_and_its_damage_is_still_found(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(64, 64))
    acc.save_state(tmp_path / "ckpt")
    saved = model.weight.detach().clone()
    _as_format_2(tmp_path / "ckpt")
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, saved)
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    with pytest.raises(HfBackendError, match=r"model.safetensors does not match its checksum"):
        acc.load_state(tmp_path / "ckpt")


def test_two_processes_hash_half_each_and_both_refuse_what_either_found(tmp_path):
    run_script("shared_verify.py", ["--out", str(tmp_path)], nproc=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = ranks[0]["total"]
    assert sum(r["hashed"] for r in ranks) == total  # every byte once
    assert all(r["hashed"] < 0.75 * total for r in ranks), ranks  # divided (pieces of 64 KiB; files are ~0.8 MB)
    assert ranks[0]["error"] == ranks[1]["error"] and "optimizer.bin does not match its checksum" in ranks[0]["error"]
