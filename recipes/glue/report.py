"""Summarize a recipe run: a results table, the loss and metric curves as a PNG, and a check that the saved model
loads with from_pretrained.

    python recipes/glue/report.py OUTPUT_DIR      # reads OUTPUT_DIR/results.json, writes OUTPUT_DIR/curves.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS = ("accuracy", "f1", "macro_f1", "matthews_correlation", "pearson", "spearmanr")


def curves(history: list[dict]) -> tuple[list[tuple[int, float]], dict[str, list[tuple[int, float]]]]:
    """(step, training loss) points and, per metric name, (step, value) points, from either flavour's history."""
    loss = [(h["step"], h["loss"]) for h in history if "loss" in h and "step" in h]
    metrics: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        for key, value in h.items():
            name = key.removeprefix("eval_")  # the Trainer logs eval_<metric>, the loop eval_<split>_<metric>
            if key.startswith("eval_") and any(name == m or name.endswith("_" + m) for m in METRICS):
                metrics.setdefault(name, []).append((h["step"], value))
    return loss, metrics


def plot(loss: list, metrics: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(*zip(*loss), color="tab:blue")
    left.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    for name, points in metrics.items():
        right.plot(*zip(*points), marker="o", label=name)
    right.set(title="evaluation", xlabel="optimizer step", ylabel="metric")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    path = out / "results.json"
    if not path.is_file():
        print(f"error: {path}: missing; run a recipe with --output_dir {out} first", file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    title = f"{results['task']}: {results['flavour']}, {results['world_size']} process(es)"
    print(f"\n{title}")
    names = sorted({k for m in results["metrics"].values() for k in m if k in METRICS}, key=METRICS.index)
    print(f"{'split':<16}" + "".join(f"{n:>22}" for n in names))
    for split, values in results["metrics"].items():
        print(f"{split:<16}" + "".join(f"{values[n]:>22.4f}" for n in names))
    samples_s, seconds = results["train_samples_per_second"], results["train_seconds"]
    print(f"training: {seconds:.1f} s wall time, {samples_s:.1f} samples/s")
    loss, metrics = curves(results["history"])
    if loss:
        plot(loss, metrics, title, out / "curves.png")
        print(f"curves: {out / 'curves.png'}")

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    size = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {out / 'model'} (from_pretrained loads it: {type(model).__name__}, {size:.1f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
