"""Engine overhead, side by side in one run: a bare PyTorch loop, the same loop on hf_backend.Accelerator, and (when
installed) on accelerate.Accelerator. Same seed, data and model for each; the variants take turns, repeat after
repeat, so drift on the machine hits them alike. Reports median steps/s and the ratio to the bare loop.

    .venv/bin/python benchmarks/run.py [--repeats 7] [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, TensorDataset


def mlp_workload() -> tuple[Callable[[], torch.nn.Module], TensorDataset, int]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g))
    return (lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))), data, 64


def bert_workload() -> tuple[Callable[[], torch.nn.Module], TensorDataset, int]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=128, num_labels=2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 1000, (2048, 64), generator=g), torch.randint(0, 2, (2048,), generator=g))

    class Classifier(torch.nn.Module):  # tensors in, logits out, like the MLP
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertForSequenceClassification(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids).logits

    return Classifier, data, 16


def _objects(factory, data, batch):
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    return model, opt, sched, loader


def _timed(loop: Callable[[int], None], warmup: int, steps: int) -> float:
    loop(warmup)
    start = time.perf_counter()
    loop(steps)
    return steps / (time.perf_counter() - start)


def bare(factory, data, batch, warmup, steps) -> float:
    model, opt, sched, loader = _objects(factory, data, batch)

    def loop(n: int) -> None:
        done = 0
        while done < n:
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                done += 1
                if done == n:
                    return

    return _timed(loop, warmup, steps)


def engine(accelerator_cls, factory, data, batch, warmup, steps) -> float:
    accelerator = accelerator_cls()
    model, opt, sched, loader = accelerator.prepare(*_objects(factory, data, batch))

    def loop(n: int) -> None:
        done = 0
        while done < n:
            for x, y in loader:
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                done += 1
                if done == n:
                    return

    rate = _timed(loop, warmup, steps)
    accelerator.free_memory()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat (BERT runs a quarter)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import hf_backend

    variants = {"bare PyTorch": None, "hf_backend": hf_backend.Accelerator}
    try:
        import accelerate

        variants["accelerate " + accelerate.__version__] = accelerate.Accelerator
    except ImportError:
        pass

    workloads = {"tiny MLP (64-256-10, batch 64)": (mlp_workload, args.steps),
                 "small BERT (2x128, seq 64, batch 16)": (bert_workload, max(10, args.steps // 4))}
    results = {}
    for name, (make, steps) in workloads.items():
        factory, data, batch = make()
        rates: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant, cls in variants.items():
                if cls is None:
                    rates[variant].append(bare(factory, data, batch, 10, steps))
                else:
                    rates[variant].append(engine(cls, factory, data, batch, 10, steps))
        medians = {v: statistics.median(r) for v, r in rates.items()}
        bare_rate = medians["bare PyTorch"]
        results[name] = {v: {"steps_per_s": m, "ratio_to_bare": m / bare_rate} for v, m in medians.items()}

    cpu = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, median of {args.repeats} repeats")
    print("| workload | variant | steps/s | vs bare loop |\n|---|---|---|---|")
    for name, by_variant in results.items():
        for variant, r in by_variant.items():
            print(f"| {name} | {variant} | {r['steps_per_s']:.1f} | {r['ratio_to_bare']:.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
