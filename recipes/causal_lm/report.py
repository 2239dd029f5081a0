"""Summarize a run_sft.py run: a results table, the training loss and held-out perplexity as a PNG, and a check that
the saved model loads with from_pretrained and answers a held-out prompt.

    python recipes/causal_lm/report.py OUTPUT_DIR     # reads OUTPUT_DIR/results.json, writes OUTPUT_DIR/loss.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sft_data import prompt_ids


def curves(history: list[dict]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, training loss) and (step, held-out perplexity) points from the Trainer's log history (its evaluation
    at step 0 is the model before training)."""
    loss = [(h["step"], h["loss"]) for h in history if "loss" in h and "step" in h]
    perplexity = [(h["step"], h["eval_perplexity"]) for h in history if "eval_perplexity" in h]
    return loss, perplexity


def plot(loss: list, perplexity: list, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(*zip(*loss), color="tab:blue")
    left.set(title="training loss (response tokens)", xlabel="optimizer step", ylabel="loss (nats/token)")
    if perplexity:
        right.plot(*zip(*perplexity), marker="o", color="tab:orange")
    right.set(title="held-out perplexity", xlabel="optimizer step", ylabel="perplexity (log scale)", yscale="log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    path = out / "results.json"
    if not path.is_file():
        print(f"error: {path}: missing; run recipes/causal_lm/run_sft.py with --output_dir {out} first",
              file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    title = f"{results['task']}: {results['flavour']}, {results['world_size']} process(es)"
    print(f"\n{title}")
    metrics = results["metrics"]
    print(f"{'held-out':<18}{'loss':>10}{'perplexity':>14}{'answers right':>16}")
    for name in [name for name in ("before training", "after training") if name in metrics]:
        m = metrics[name]
        match = f"{m['answer_match']:.1%}" if "answer_match" in m else ""
        print(f"{name:<18}{m['loss']:>10.4f}{m['perplexity']:>14.2f}{match:>16}")
    train = metrics["training"]
    print(f"training: {results['train_seconds']:.1f} s wall time, {results['train_samples_per_second']:.1f} "
          f"samples/s, {train['tokens_per_second']:.0f} tokens/s; logged loss {train['first_logged_loss']:.4f} "
          f"-> {train['last_logged_loss']:.4f}")
    loss, perplexity = curves(results["history"])
    if loss:
        plot(loss, perplexity, title, out / "loss.png")
        print(f"curves: {out / 'loss.png'}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    size = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {out / 'model'} (from_pretrained loads it: {type(model).__name__}, {size:.1f}M parameters)")
    samples = json.loads((out / "samples.json").read_text())
    if samples:
        sample = samples[0]
        ids = torch.tensor(prompt_ids(tokenizer, [sample["prompt"]]))
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True).strip()
        print(f"prompt: {sample['prompt']!r}\nloaded model answers: {text!r} (reference {sample['reference']!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
