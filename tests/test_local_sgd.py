"""LocalSGD against its definition: local optimizer steps on each process's own gradients, and every N steps (and at
the end of the block) every parameter replaced by its mean over the processes.

Run as a script (`python test_local_sgd.py --out r.json`, in 2 processes) this file is also the job the 2-process
test starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_backend import Accelerator
from hf_backend.core.enums import DistributedType
from hf_backend.core.errors import HfBackendError
from hf_backend.local_sgd import LocalSGD

EVERY = 3  # local_sgd_steps
STEPS = 7  # not a multiple of EVERY: the block's exit averages the last local steps


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _train_step(accelerator, model, optimizer, x, y) -> torch.Tensor:
    """One step of the Accelerate example's loop; returns the gradient the optimizer stepped with."""
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        grad = _flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return grad


def _local_grad(accelerator, model, x, y) -> torch.Tensor:
    """What this process's gradient is on its own batch, computed on a plain copy of the module."""
    reference = _model()
    reference.load_state_dict(accelerator.unwrap_model(model).state_dict())
    torch.nn.functional.mse_loss(reference(x), y).backward()
    return _flat(p.grad for p in reference.parameters())


def _run_local_sgd(accelerator) -> dict:
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    steps = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=EVERY) as local_sgd:
        for step, (x, y) in enumerate(_batches(accelerator.process_index), start=1):
            expected_grad = _local_grad(accelerator, model, x, y)
            grad = _train_step(accelerator, model, optimizer, x, y)
            before = _flat(model.parameters())
            everyone_before = accelerator.gather(before[None])  # each rank's parameters after its local update
            local_sgd.step()
            after = _flat(model.parameters())
            everyone_after = accelerator.gather(after[None])
            steps.append({
                "step": step,
                "grad_is_local": torch.allclose(grad, expected_grad, atol=1e-7),
                "grads_differ": not torch.allclose(*accelerator.gather(grad[None]), atol=1e-4),
                "error_to_mean": (after - everyone_before.mean(0)).abs().max().item(),
                "unchanged": torch.equal(after, before),
                "ranks_differ": not torch.allclose(*everyone_after, atol=1e-4),
            })
        everyone_before_exit = accelerator.gather(_flat(model.parameters())[None])
    after_exit = _flat(model.parameters())
    return {"steps": steps, "exit_error_to_mean": (after_exit - everyone_before_exit.mean(0)).abs().max().item(),
            "exit_changed": not torch.equal(after_exit, everyone_before_exit[accelerator.process_index]),
            "ranks_equal_after_exit": torch.equal(*accelerator.gather(after_exit[None]))}


def _run_disabled(accelerator) -> dict:
    """enabled=False: plain DDP, gradients all-reduced on every step."""
    model = accelerator.prepare(_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    agree = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=EVERY, enabled=False) as local_sgd:
        for x, y in _batches(accelerator.process_index):
            _train_step(accelerator, model, optimizer, x, y)
            local_sgd.step()
            agree.append(torch.equal(*accelerator.gather(_flat(model.parameters())[None])))
    return {"ranks_agree": agree}


def _worker(argv: list[str]) -> None:
    out = Path(argv[argv.index("--out") + 1])
    accelerator = Accelerator()
    report = {"world": accelerator.num_processes, "local_sgd": _run_local_sgd(accelerator),
              "disabled": _run_disabled(accelerator)}
    try:
        LocalSGD(accelerator=accelerator, model=_model(), local_sgd_steps=2)
        report["unwrapped_model_error"] = None
    except HfBackendError as err:
        report["unwrapped_model_error"] = str(err)
    if accelerator.is_main_process:
        out.write_text(json.dumps(report))
    accelerator.end_training()


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    from helpers import run_report

    return run_report(Path(__file__).resolve(), tmp_path_factory.mktemp("local_sgd") / "r.json", [], nproc=2)


def test_between_averages_each_rank_steps_on_its_own_gradient(two):
    assert two["world"] == 2
    for record in two["local_sgd"]["steps"]:
        assert record["grad_is_local"], f"step {record['step']}: the gradient was all-reduced inside LocalSGD"
        assert record["grads_differ"], f"step {record['step']}: the ranks' data differ, so must their gradients"


def test_every_nth_step_parameters_become_the_mean_of_the_local_ones(two):
    for record in two["local_sgd"]["steps"]:
        if record["step"] % EVERY == 0:
            assert record["error_to_mean"] < 1e-6, f"step {record['step']}: not averaged"
            assert not record["ranks_differ"]
            assert not record["unchanged"]
        else:
            assert record["unchanged"], f"step {record['step']}: step() changed parameters between averages"
            assert record["ranks_differ"], f"step {record['step']}: ranks agree between averages"


def test_leaving_the_block_averages_once_more(two):
    result = two["local_sgd"]
    assert result["exit_changed"] and result["exit_error_to_mean"] < 1e-6 and result["ranks_equal_after_exit"]


def test_disabled_is_plain_data_parallel(two):
    assert all(two["disabled"]["ranks_agree"])


def test_model_must_be_the_prepared_one(two):
    message = two["unwrapped_model_error"]
    assert message and "accelerator.prepare()" in message and "\n" not in message


def test_one_process_is_a_no_op():
    accelerator = Accelerator()
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference = _model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as local_sgd:
        assert not local_sgd.enabled
        for x, y in _batches(0):
            _train_step(accelerator, model, optimizer, x, y)
            local_sgd.step()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    assert local_sgd.num_steps == STEPS
    assert torch.equal(_flat(model.parameters()), _flat(reference.parameters()))


@pytest.mark.parametrize("steps", [0, -2, 2.5, "3", None, True])
def test_bad_local_sgd_steps_is_one_line(steps):
    with pytest.raises(HfBackendError) as err:
        LocalSGD(accelerator=Accelerator(), model=_model(), local_sgd_steps=steps)
    assert "local_sgd_steps" in str(err.value) and "\n" not in str(err.value)


def test_disabled_accepts_any_steps():
    """Accelerate's example passes `enabled=local_sgd_steps is not None`: a disabled LocalSGD ignores the value."""
    with LocalSGD(accelerator=Accelerator(), model=_model(), local_sgd_steps=None, enabled=False) as local_sgd:
        local_sgd.step()


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_sharded_strategies_are_refused(kind):
    accelerator = SimpleNamespace(distributed_type=kind, num_processes=2)
    with pytest.raises(HfBackendError) as err:
        LocalSGD(accelerator=accelerator, model=_model(), local_sgd_steps=2)
    message = str(err.value)  # the prepared model is no DDP model (an FSDPModule, DeepSpeed's engine)
    assert "whole parameters of a DDP model" in message and "FSDP and DeepSpeed" in message and "\n" not in message


if __name__ == "__main__":
    _worker(sys.argv[1:])
