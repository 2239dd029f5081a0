"""Accelerate's everyday API in 2 processes (tests/test_accelerate_api.py): each check runs on both ranks, in the same
order; each rank writes what it saw to `<out>.rank<r>.json` after every check (a check that raised records its error
instead; the per-process save_state check, which hangs an engine without it, runs last). The log records of every
rank go to `<out>.log` (one shared file, appended in emission order).

Run under torchrun (or tests/warm_processes.py) with 2 processes: `api_two_procs.py --out F --ckpt-root DIR`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ckpt-root", required=True)
args = parser.parse_args()
RANK = int(os.environ["RANK"])
OUT = Path(args.out)
report: dict = {"rank": RANK}
CHECKS = []


def check(function):
    CHECKS.append(function)
    return function


@check
def partial_state():
    from hf_backend import PartialState

    state = PartialState()  # before any Accelerator: it sets the process group up itself
    order = OUT.with_suffix(".first")
    with state.main_process_first():
        if state.is_main_process:
            time.sleep(0.3)  # rank 1 must still wait for this
        with order.open("a") as f:
            f.write(str(state.process_index))
    state.wait_for_everyone()
    with state.split_between_processes([1, 2, 3]) as part:
        split = part

    def where() -> int:
        return state.process_index

    state.print(f"PARTIAL_STATE_PRINT from {RANK}")
    return {
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "device": str(state.device),
        "distributed_type": str(state.distributed_type.value),
        "is_main_process": state.is_main_process,
        "first_order": order.read_text(),
        "split": split,
        "on_main_process": state.on_main_process(where)(),
        "on_process_1": state.on_process(process_index=1)(where)(),
        "on_process_1_decorator": state.on_process(where, process_index=1)(),
        "on_local_process_1": state.on_local_process(local_process_index=1)(where)(),
        "destroy_process_group": callable(getattr(state, "destroy_process_group", None)),
    }


def accelerator(**kwargs):
    from hf_backend import Accelerator

    return Accelerator(**kwargs)


@check
def accelerator_state():
    acc = accelerator()
    acc.state.print(f"ACCELERATOR_STATE_PRINT from {RANK}")
    acc.state.wait_for_everyone()
    return {"distributed_type": str(acc.state.distributed_type.value), "num_processes": acc.state.num_processes}


@check
def tqdm_bar():
    from hf_backend.utils import tqdm

    bar = tqdm(range(3))
    disable = bool(bar.disable)  # read before iterating: tqdm's close() at the end sets it
    return {"disable": disable, "items": list(bar)}


@check
def triggers():
    acc = accelerator()
    if RANK == 1:
        acc.set_trigger()
    return {"first": acc.check_trigger(), "second": acc.check_trigger()}


@check
def on_process():
    acc = accelerator()
    calls = []

    @acc.on_process(process_index=1)
    def only_on_1():
        calls.append(RANK)
        return "ran"

    return {"result": only_on_1(), "calls": calls}


@check
def join_uneven_inputs():
    torch.manual_seed(0)
    acc = accelerator()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # 20 rows in batches of 4: 5 batches, so with even_batches=False rank 0 gets 3 and rank 1 gets 2.
    loader = DataLoader(TensorDataset(torch.arange(20.0)[:, None]), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    before = len(loader)
    steps = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        inside = len(loader)
        for (x,) in loader:
            acc.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            steps += 1
    acc.wait_for_everyone()
    return {"ddp": type(model).__name__, "len_before": before, "len_inside": inside, "steps": steps,
            "len_after": len(loader), "even_batches_after": loader.source.even_batches}


@check
def loader_sizes():
    out = {}
    for split in (False, True):
        acc = accelerator(split_batches=split)
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4))
        out[f"split={split}"] = {"total_batch_size": loader.total_batch_size, "batch_size": loader.batch_size,
                                 "total_dataset_length": loader.total_dataset_length,
                                 "first": next(iter(loader))[0].tolist()}
    return out


class ListIndexed(torch.utils.data.Dataset):
    """A dataset read a whole batch at a time: `__getitem__` takes the list of indices a BatchSampler yields."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, indices):
        return torch.tensor(indices) * 10


@check
def batch_sampler_as_sampler():
    acc = accelerator()
    loader = DataLoader(ListIndexed(), sampler=BatchSampler(SequentialSampler(range(12)), 3, False), batch_size=None)
    loader = acc.prepare(loader)
    return {"batches": [b.tolist() for b in loader]}


@check
def reduce():
    acc = accelerator()
    t = torch.tensor([RANK + 1.0, 10.0 * (RANK + 1)])
    from hf_backend.utils import reduce as utils_reduce

    return {r: acc.reduce(t, r).tolist() for r in ("max", "sum", "mean", "none")} | {
        "utils_max": utils_reduce(t, "max").tolist()}


@check
def logging_calls():
    from hf_backend.logging import get_logger

    accelerator()
    shared = OUT.with_suffix(".log")
    base = logging.getLogger("api_two_procs")
    handler = logging.FileHandler(shared, mode="a")
    handler.setFormatter(logging.Formatter("%(message)s"))
    base.addHandler(handler)
    base.propagate = False
    logger = get_logger("api_two_procs", log_level="INFO")
    logger.info(f"main-only from {RANK}")
    logger.info(f"everyone from {RANK}", main_process_only=False)
    if RANK == 1:
        time.sleep(0.3)  # rank 1 arrives late: in_order must still put rank 0 first
    logger.info(f"ordered from {RANK}", in_order=True)
    handler.close()
    return {"ok": True}


@check
def trigger_sync_in_backward():
    """Accelerate's form: a context manager; under no_sync, the backward inside it all-reduces the gradients."""
    torch.manual_seed(0)
    acc = accelerator()
    model = acc.prepare(torch.nn.Linear(2, 1))
    x_a, x_b = torch.full((1, 2), RANK + 1.0), torch.full((1, 2), 3.0 * (RANK + 1))
    with acc.no_sync(model):
        loss_a = model(x_a).sum()
        loss_b = model(x_b).sum()
    acc.backward(loss_a)  # not synchronized
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss_b)  # synchronized: the average over the ranks of each rank's accumulated gradient
    grad = acc.unwrap_model(model).weight.grad
    local = (x_a + x_b).sum(0)  # d/dW of sum(W x_a + b) + sum(W x_b + b)
    return {"grad": grad.tolist(), "local": local.tolist()}


@check
def save_state_per_rank_dirs():
    torch.manual_seed(0)
    acc = accelerator()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.ones(2, 3)).sum())
    opt.step()
    mine = Path(args.ckpt_root) / f"rank{RANK}"
    acc.save_state(mine)
    acc.wait_for_everyone()
    return {"dir": str(mine), "files": sorted(p.name for p in mine.iterdir()),
            "weight": acc.unwrap_model(model).weight.tolist()}


for function in CHECKS:
    try:
        report[function.__name__] = function()
    except Exception as error:  # noqa: BLE001 - recorded for the test to show
        report[function.__name__] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    Path(f"{OUT}.rank{RANK}.json").write_text(json.dumps(report, indent=1))  # after each check: a hang keeps the rest
