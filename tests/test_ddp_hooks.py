"""DDP gradient communication hooks (DistributedDataParallelKwargs comm_hook / comm_wrapper / comm_state_option):
registered at prepare, observed through the gradients they produce, refused with one line when invalid.

Run as a script (`python test_ddp_hooks.py --out r.json`, in 2 processes) this file is also the job the 2-process
tests share.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_backend.config.options import DistributedDataParallelKwargs as Kwargs
from hf_backend.core.errors import HfBackendError
from hf_backend.strategies import ddp

STEPS = 4
POWER_SGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}  # exact all-reduce on steps 0 and 1
CASES = {
    "no": Kwargs(),
    "fp16": Kwargs(comm_hook="fp16"),
    "bf16": Kwargs(comm_hook="bf16"),
    "power_sgd": Kwargs(comm_hook="power_sgd", comm_state_option=POWER_SGD),
    "fp16_power_sgd": Kwargs(comm_hook="power_sgd", comm_wrapper="fp16", comm_state_option=POWER_SGD),
    "batched_power_sgd": Kwargs(comm_hook="batched_power_sgd", comm_state_option=POWER_SGD),
    "bad_at_prepare": Kwargs(comm_wrapper="fp16"),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)  # weight 8x16: PowerSGD compresses it (rank 1); bias 1-D: all-reduced as is


def _case(name: str, handler: Kwargs) -> dict:
    from hf_backend import Accelerator

    accelerator = Accelerator(kwargs_handlers=[handler])
    model = _model()
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    except HfBackendError as err:
        return {"error": str(err)}
    g = torch.Generator().manual_seed(10 + accelerator.process_index)  # each rank its own data
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        plain = _model()
        plain.load_state_dict(accelerator.unwrap_model(model).state_dict())
        torch.nn.functional.mse_loss(plain(x), y).backward()
        exact = accelerator.gather(torch.cat([plain.weight.grad, plain.bias.grad[:, None]], 1)[None]).mean(0)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        weight, bias = model.module.weight.grad, model.module.bias.grad
        singular = torch.linalg.svdvals(weight)
        steps.append({
            "weight_error": (weight - exact[:, :-1]).abs().max().item(),
            "bias_error": (bias - exact[:, -1]).abs().max().item(),
            "relative_error": ((weight - exact[:, :-1]).norm() / exact[:, :-1].norm()).item(),
            "fp16_exact": torch.equal(weight, weight.half().float()),
            "second_singular_ratio": (singular[1] / singular[0]).item(),
        })
        optimizer.step()
        optimizer.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"hooks": [hook.__name__ for hook, _ in model._comm_hooks], "steps": steps,
            "ranks_agree": torch.equal(*accelerator.gather(flat[None]))}


def _worker(argv: list[str]) -> None:
    out = Path(argv[argv.index("--out") + 1])
    report = {name: _case(name, handler) for name, handler in CASES.items()}
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(report))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from helpers import run_report

    return run_report(Path(__file__).resolve(), tmp_path_factory.mktemp("hooks") / "r.json", [], nproc=2)


def _one_line(message: str | None, *words: str) -> None:
    assert message and "\n" not in message and all(w in message for w in words), message


def test_without_a_hook_gradients_are_the_exact_mean(report):
    case = report["no"]
    assert case["hooks"] == [] and case["ranks_agree"]
    assert all(s["weight_error"] < 1e-6 and s["bias_error"] < 1e-6 for s in case["steps"])


def test_fp16_compression_rounds_the_mean_to_fp16(report):
    case = report["fp16"]
    assert case["hooks"] == ["fp16_compress_hook"] and case["ranks_agree"]
    steps = case["steps"]
    assert all(s["fp16_exact"] and s["relative_error"] < 2e-3 for s in steps)
    assert any(s["weight_error"] > 0 for s in steps), "fp16 compression must lose some fp32 precision"


def test_power_sgd_is_exact_before_its_start_step_then_rank_one(report):
    case = report["power_sgd"]
    assert case["hooks"] == ["powerSGD_hook"] and case["ranks_agree"]
    exact, compressed = case["steps"][:2], case["steps"][2:]
    assert all(s["weight_error"] < 1e-6 for s in exact)
    for s in compressed:
        assert s["second_singular_ratio"] < 1e-5, "rank 1 PowerSGD gives a rank-1 weight gradient"
        assert s["relative_error"] > 1e-2, "a rank-1 approximation differs from the exact mean"
        assert s["bias_error"] < 1e-6, "1-D tensors are all-reduced uncompressed"


def test_fp16_wrapper_compresses_around_power_sgd(report):
    case = report["fp16_power_sgd"]
    assert case["hooks"] == ["fp16_compress_wrapper_hook"] and case["ranks_agree"]
    compressed = case["steps"][2:]
    assert all(s["fp16_exact"] and s["second_singular_ratio"] < 1e-2 and s["relative_error"] > 1e-2
               for s in compressed)


def test_bf16_hooks_run_where_torch_allows_them(report):
    case = report["bf16"]
    if ddp._bf16_supported():
        assert case["hooks"] == ["bf16_compress_hook"] and case["ranks_agree"]
    else:  # a CPU-only torch build refuses them (gloo itself all-reduces bf16)
        _one_line(case.get("error"), "comm_hook='bf16'", "'fp16'")


def test_batched_power_sgd_runs_or_is_refused_in_one_line(report):
    case = report["batched_power_sgd"]
    if ddp._batched_power_sgd_works():
        assert case["hooks"] == ["batched_powerSGD_hook"] and case["ranks_agree"]
    else:  # torch 2.13: fails inside torch on the first compressed step, on any device
        _one_line(case.get("error"), "batched_power_sgd", "'power_sgd'")


def test_a_bad_combination_fails_at_prepare(report):
    _one_line(report["bad_at_prepare"].get("error"), "comm_wrapper='fp16'", "power_sgd")


@pytest.mark.parametrize(("handler", "words"), [
    (Kwargs(comm_hook="int8"), ("comm_hook='int8'", "'power_sgd'")),
    (Kwargs(comm_hook="power_sgd", comm_wrapper="power_sgd"), ("comm_wrapper='power_sgd'", "'fp16'")),
    (Kwargs(comm_hook="fp16", comm_wrapper="fp16"), ("comm_wrapper='fp16'", "comm_hook='power_sgd'")),
    (Kwargs(comm_hook="fp16", comm_state_option={"matrix_approximation_rank": 2}), ("comm_state_option",)),
    (Kwargs(comm_hook="power_sgd", comm_state_option={"rank": 2}), ("'rank'", "matrix_approximation_rank")),
    (Kwargs(comm_hook="power_sgd", comm_state_option={"start_powerSGD_iter": 1}), ("start_powerSGD_iter",)),
    (Kwargs(comm_hook="power_sgd", comm_state_option=[("matrix_approximation_rank", 2)]), ("dict",)),
])
def test_invalid_options_are_one_line(handler, words):
    with pytest.raises(HfBackendError) as err:
        ddp.communication_hook(handler)
    _one_line(str(err.value), *words)


def test_enum_members_and_their_values_are_both_accepted():
    from hf_backend.core.enums import DDPCommunicationHookType

    assert ddp.communication_hook(Kwargs()) is None
    hook, state = ddp.communication_hook(Kwargs(comm_hook=DDPCommunicationHookType.FP16))
    assert hook.__name__ == "fp16_compress_hook" and state is None
    hook, state = ddp.communication_hook(Kwargs(comm_hook="power_sgd", comm_wrapper=DDPCommunicationHookType.FP16,
                                                comm_state_option={"matrix_approximation_rank": 3}))
    assert hook.__name__ == "fp16_compress_wrapper_hook" and state.matrix_approximation_rank == 3


if __name__ == "__main__":
    _worker(sys.argv[1:])
