"""`notebook_launcher` / `debug_launcher`: a function defined in a notebook's `__main__` runs on 2 forked processes.

Each test writes a small "notebook" (a script run as `__main__`, forked from the warm interpreter of
tests/warm_processes.py) that defines its function and launches it, as a notebook cell would; the workers and the
notebook write what they saw as JSON.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import pytest
from helpers import free_port, run_script

from hf_backend import HfBackendError, debug_launcher, notebook_launcher

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import json, os, signal, sys, time
import torch
from hf_backend import Accelerator, HfBackendError, PartialState, debug_launcher, notebook_launcher

OUT, PORT = sys.argv[1], sys.argv[2]
ENV_BEFORE = dict(os.environ)
SIGNALS_BEFORE = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
report = {}


def seen(accelerator, **extra):
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "HF_BACKEND_MIXED_PRECISION", "HF_BACKEND_USE_CPU", "HF_BACKEND_DISTRIBUTED_TYPE", "OMP_NUM_THREADS")
    data = {"index": accelerator.process_index, "world": accelerator.num_processes,
            "partial_world": PartialState().num_processes, "device": str(accelerator.device),
            "mixed_precision": accelerator.mixed_precision, "env": {n: os.environ.get(n) for n in names},
            "gathered": accelerator.gather(torch.tensor([accelerator.process_index])).tolist(), **extra}
    with open(os.path.join(OUT, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(data, f)


def done():
    changed = set(os.environ) | set(ENV_BEFORE)
    report["env_changed"] = sorted(k for k in changed if os.environ.get(k) != ENV_BEFORE.get(k))
    report["signals_kept"] = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == SIGNALS_BEFORE
    with open(os.path.join(OUT, "report.json"), "w") as f:
        json.dump(report, f)
"""


def notebook(tmp_path: Path, cell: str, nproc: int = 1) -> tuple[dict, list[dict]]:
    """Run PRELUDE + `cell` as `__main__`; return the notebook's report and each worker's."""
    script = tmp_path / "notebook.py"
    script.write_text(PRELUDE + textwrap.dedent(cell) + "\ndone()\n")
    run_script(script, [str(tmp_path), str(free_port())], nproc=nproc, timeout=90)
    report = json.loads((tmp_path / "report.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    return report, ranks


def test_a_function_in_main_trains_one_model_with_ddp_on_two_processes(tmp_path):
    report, ranks = notebook(tmp_path, """
        def train(lr):
            accelerator = Accelerator()
            assert accelerator.num_processes == 2, accelerator.num_processes
            torch.manual_seed(accelerator.process_index)  # different initial weights: DDP must make them one model
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
            model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, 4))
            for x, y in loader:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            weights = [v for p in accelerator.unwrap_model(model).parameters() for v in p.flatten().tolist()]
            seen(accelerator, weights=weights, steps=len(loader), wrapped=type(model).__name__)

        notebook_launcher(train, (0.1,), num_processes=2, mixed_precision="bf16", use_port=PORT)
    """)
    assert [r["index"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["gathered"] == [0, 1] and r["steps"] == 4 for r in ranks)  # 32 samples / 2 ranks / batch 4
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["wrapped"] == "DistributedDataParallel" and ranks[0]["mixed_precision"] == "bf16"
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] and ranks[0]["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert ranks[1]["env"]["HF_BACKEND_DISTRIBUTED_TYPE"] == "MULTI_CPU"
    assert ranks[1]["env"]["HF_BACKEND_USE_CPU"] == "true" and ranks[1]["device"] == "cpu"
    assert report["env_changed"] == [] and report["signals_kept"]


def test_a_failing_rank_raises_one_line_naming_it_and_the_others_are_stopped(tmp_path):
    report, _ = notebook(tmp_path, """
        import torch.distributed as dist

        def train():
            accelerator = Accelerator()
            accelerator.wait_for_everyone()
            if accelerator.process_index == 1:
                raise ValueError("boom")
            # Ranks 0 and 2 wait for each other inside gloo, which never notices rank 1 is gone: only the launcher
            # stopping them ends this.
            dist.recv(torch.zeros(1), src=2 - accelerator.process_index)

        start = time.monotonic()
        try:
            notebook_launcher(train, num_processes=3, use_port=PORT)
        except HfBackendError as error:
            report["error"] = str(error)
        report["seconds"] = time.monotonic() - start
        import psutil
        report["children"] = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    """)
    assert report["error"] == ("notebook_launcher: rank 1 (local rank 1) exited with code 1: ValueError: boom; the "
                               "other workers were stopped")
    assert report["seconds"] < 20  # torch elastic's agent waits 30 s for a worker that defers SIGTERM
    assert report["children"] == []
    assert report["env_changed"] == [] and report["signals_kept"]


def test_the_parents_environment_and_signal_handlers_are_as_before(tmp_path):
    report, ranks = notebook(tmp_path, """
        os.environ.pop("OMP_NUM_THREADS", None)  # so that the launcher sets it, for the workers only
        os.environ["HF_BACKEND_MIXED_PRECISION"] = "fp16"  # exported before; the launcher's argument ("no") wins
        ENV_BEFORE = dict(os.environ)

        def train():
            seen(Accelerator())

        notebook_launcher(train, num_processes=2, use_port=PORT)
        report["after_success"] = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT",
                                                                   "HF_BACKEND_MIXED_PRECISION", "OMP_NUM_THREADS")}
        try:
            notebook_launcher(lambda: sys.exit(3), num_processes=2, use_port=PORT)  # the same port again
        except HfBackendError as error:
            report["error"] = str(error)
    """)
    assert report["after_success"] == {"RANK": None, "WORLD_SIZE": None, "MASTER_PORT": None,
                                       "HF_BACKEND_MIXED_PRECISION": "fp16", "OMP_NUM_THREADS": None}
    assert ranks[0]["env"]["OMP_NUM_THREADS"] is not None and ranks[0]["mixed_precision"] == "no"
    assert "exited with code 3" in report["error"]
    assert report["env_changed"] == [] and report["signals_kept"]


def test_debug_launcher_runs_two_cpu_processes_on_a_free_port(tmp_path):
    report, ranks = notebook(tmp_path, """
        def check(tag):
            seen(Accelerator(), tag=tag)

        debug_launcher(check, ("x",))
    """)
    assert [r["index"] for r in ranks] == [0, 1] and all(r["gathered"] == [0, 1] for r in ranks)
    assert all(r["tag"] == "x" and r["device"] == "cpu" and r["env"]["HF_BACKEND_USE_CPU"] == "true" for r in ranks)
    assert report["env_changed"] == []


def test_an_accelerator_built_in_the_notebook_does_not_leak_into_the_workers(tmp_path):
    report, ranks = notebook(tmp_path, """
        parent = Accelerator(mixed_precision="bf16")  # an earlier cell, in this single process
        assert parent.num_processes == 1

        def train():
            from hf_backend.state import AcceleratorState

            state = AcceleratorState()  # before any Accelerator of this worker: the notebook's must not show through
            seen(Accelerator(), state=[state.num_processes, state.mixed_precision])

        notebook_launcher(train, num_processes=2, use_port=PORT)
        report["parent_after"] = [parent.num_processes, PartialState().num_processes, Accelerator().num_processes]
    """)
    assert [(r["index"], r["world"], r["partial_world"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    assert all(r["mixed_precision"] == "no" and r["state"] == [2, "no"] for r in ranks)
    assert report["parent_after"] == [1, 1, 1]


def test_a_notebook_with_a_process_group_is_refused(tmp_path):
    report, _ = notebook(tmp_path, """
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            notebook_launcher(print, num_processes=2, use_port=PORT)
        except HfBackendError as error:
            report["error"] = str(error)
        dist.destroy_process_group()
    """)
    assert "already joined a torch.distributed process group" in report["error"]


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_notebooks_form_one_two_node_job(tmp_path, backend):
    """Each of 2 "machines" (processes on 127.0.0.1) launches 1 process; together they are one job of 2."""
    report, ranks = notebook(tmp_path, f"""
        node = int(os.environ.pop("RANK"))  # the warm starter's rank: here, which machine this is
        port = os.environ["MASTER_PORT"]
        for name in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
            os.environ.pop(name)
        ENV_BEFORE = dict(os.environ)

        def train():
            seen(Accelerator())

        notebook_launcher(train, num_processes=1, num_nodes=2, node_rank=node, use_port=port,
                          rdzv_backend="{backend}", rdzv_id="two-nodes")
    """, nproc=2)
    assert sorted((r["index"], r["world"], r["env"]["LOCAL_RANK"]) for r in ranks) == [(0, 2, "0"), (1, 2, "0")]
    assert all(r["gathered"] == [0, 1] for r in ranks) and report["env_changed"] == []


def test_one_process_runs_the_function_here_with_the_settings_and_restores_them():
    import os

    calls, before = [], dict(os.environ)
    notebook_launcher(lambda a, b: calls.append((a, b, os.environ.get("HF_BACKEND_MIXED_PRECISION"))), ("a", 1),
                      mixed_precision="fp16")
    debug_launcher(lambda: calls.append(os.environ.get("HF_BACKEND_USE_CPU")), num_processes=1)
    assert calls == [("a", 1, "fp16"), "true"] and dict(os.environ) == before


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"use_port": "http"}, "use_port='http' must be an integer >= 0"),
    ({"use_port": 70000}, "use_port=70000 is not a port"),
    ({"num_processes": 0}, "num_processes=0 must be an integer >= 1"),
    ({"num_processes": 2.5}, "num_processes=2.5 must be an integer"),
    ({"mixed_precision": "fp32"}, "mixed_precision='fp32' is not one of no, fp16, bf16"),
    ({"num_nodes": 2, "node_rank": 2}, "node_rank=2 must be below num_nodes=2"),
    ({"rdzv_backend": "zookeeper"}, "rdzv_backend='zookeeper' is not one of"),
    ({"num_nodes": 2, "use_port": 0}, "use_port=0 (a free port) works on one machine only"),
    ({"max_restarts": -1}, "max_restarts=-1 must be an integer >= 0"),
])
def test_bad_arguments_are_one_line(kwargs, message):
    start = time.monotonic()
    with pytest.raises(HfBackendError) as caught:
        notebook_launcher(print, **{"num_processes": 2, **kwargs})
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("notebook_launcher: ") and time.monotonic() - start < 1


def test_a_taken_port_is_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HfBackendError) as caught:
            notebook_launcher(print, num_processes=2, use_port=str(port))
    assert str(caught.value) == (f"notebook_launcher: 127.0.0.1:{port} is in use (another job, or a worker left from "
                                 "an earlier launch); pass another use_port, or use_port=0 for a free one")


@pytest.mark.parametrize(("initialized", "gpus", "message"), [
    (True, 2, "CUDA is already initialized in this interpreter"),
    (False, 1, "num_processes=2 but this machine has 1 GPU(s)"),
])
def test_on_a_gpu_machine_an_unsafe_fork_is_refused(monkeypatch, initialized, gpus, message):
    """Simulated: this machine has no GPU. No process is started either way."""
    import torch

    from hf_backend.launch import notebook as launchers

    monkeypatch.setattr(launchers, "_cuda_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(HfBackendError, match=re.escape(message)):
        notebook_launcher(print, num_processes=2)
