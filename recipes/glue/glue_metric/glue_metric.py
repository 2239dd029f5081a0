"""The official GLUE metric of each task, as an `evaluate` metric module shipped with the recipes (a Hub metric
cannot be loaded offline): `evaluate.load("recipes/glue/glue_metric/glue_metric.py", "<task>")`.

accuracy for sst2, mnli, qnli, rte, wnli; accuracy and F1 (of class 1) for mrpc and qqp; Matthews correlation for
cola; Pearson and Spearman correlation for stsb; accuracy and macro F1 for tweets (3 classes). numpy only.
"""

import datasets
import evaluate
import numpy as np

TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli", "tweets")


def _f1(predictions: np.ndarray, references: np.ndarray, positive: int) -> float:
    tp = np.sum((predictions == positive) & (references == positive))
    fp = np.sum((predictions == positive) & (references != positive))
    fn = np.sum((predictions != positive) & (references == positive))
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0


def _matthews(predictions: np.ndarray, references: np.ndarray) -> float:
    tp = np.sum((predictions == 1) & (references == 1))
    tn = np.sum((predictions == 0) & (references == 0))
    fp = np.sum((predictions == 1) & (references == 0))
    fn = np.sum((predictions == 0) & (references == 1))
    denominator = np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their average rank (as scipy.stats.rankdata does)."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x.astype(np.float64), y.astype(np.float64))[0, 1])


class GlueMetric(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in TASKS:
            raise KeyError(f"unknown GLUE task {self.config_name!r}; use one of {', '.join(TASKS)}")
        kind = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description="GLUE task metrics (hf_backend recipes)", citation="", inputs_description=__doc__,
            features=datasets.Features({"predictions": datasets.Value(kind), "references": datasets.Value(kind)}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        task = self.config_name
        if task == "stsb":
            return {"pearson": _pearson(p, r), "spearmanr": _pearson(_ranks(p), _ranks(r))}
        if task == "cola":
            return {"matthews_correlation": _matthews(p, r)}
        accuracy = float(np.mean(p == r))
        if task in ("mrpc", "qqp"):
            return {"accuracy": accuracy, "f1": _f1(p, r, positive=1)}
        if task == "tweets":
            return {"accuracy": accuracy, "macro_f1": float(np.mean([_f1(p, r, c) for c in range(3)]))}
        return {"accuracy": accuracy}
