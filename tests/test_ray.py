"""hf_backend inside Ray Train's TorchTrainer: one local Ray cluster (2 CPU workers) for the whole module.

The loop in tests/scripts/ray_loop.py runs unchanged under `hf-backend launch --num_processes 2` and in Ray; the Ray
runs with a DataLoader (DDP, FSDP, DeepSpeed ZeRO-3) crash once after an epoch and continue from the checkpoint they
reported, and must still end where the launcher's uninterrupted run ends.

Every Ray run of the module starts when the module does, two at a time (`runs`), and each test reads its own: much
of a run is spent waiting (worker processes starting, actors created one after the other, the controller polling),
which the other run fills.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import CLI, OFFLINE, SCRIPTS, cli_env, recipe_args

ray = pytest.importorskip("ray")
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

# The worker functions (tests/scripts/ray_loop.py, recipes/ray/run_glue_ray.py): this process imports them through
# pytest's `pythonpath` (pyproject.toml), the Ray workers through the PYTHONPATH that ray_cluster sets.
RECIPE_DIRS = [Path(__file__).parent.parent / "recipes" / d for d in ("glue", "ray")]

pytestmark = pytest.mark.timeout(400)
EPOCHS = 3


@pytest.fixture(scope="module")
def reference_launch(request, tmp_path_factory):
    """The launcher's run that `launched` reads, started with the module (before the cluster) so that it runs while
    Ray starts and trains the Ray Data tests; not started when no selected test needs it."""
    if not any("launched" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    out, logs = tmp_path_factory.mktemp("launched"), tmp_path_factory.mktemp("launcher_log")
    with (logs / "output.txt").open("w") as sink:
        proc = subprocess.Popen([*CLI, "launch", "--cpu", "--num_processes", "2", str(SCRIPTS / "ray_loop.py"), "--out",
                                 str(out), "--epochs", str(EPOCHS)], stdout=sink, stderr=subprocess.STDOUT,
                                env=cli_env())
    yield proc, out, logs / "output.txt"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(reference_launch):
    """CPUs for two runs of two one-CPU workers each, and two more for Ray Data's own tasks."""
    # Ray Train's controller polls its workers every 2 s by default: each fit would wait that long to notice the end
    # (or a crash) of its workers. Its preemption watcher (a process more per worker group, about 1.5 s of CPU to
    # start) watches for the node being drained, which a local cluster never is.
    # Two worker groups start at once here: a start may take longer than Ray's default limit of 60 s under load.
    settings = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
                "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300", **OFFLINE}
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", *settings)}
    # The workers import the test scripts and recipes; the local cluster's processes inherit the driver's environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), *map(str, RECIPE_DIRS),
                                                             saved["PYTHONPATH"]]))
    os.environ.update(settings)
    ray.init(num_cpus=6, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def fit(function, config: dict, storage: Path, **kwargs):
    trainer = TorchTrainer(function, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=str(storage), name="run",
                                                failure_config=FailureConfig(max_failures=1)), **kwargs)
    return trainer.fit()


def records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def launched(reference_launch) -> list[dict]:
    """The same loop and seed under `hf-backend launch --num_processes 2`."""
    proc, out, output = reference_launch
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"hf-backend launch ray_loop.py: killed after 240 s\n{output.read_text()[-4000:]}")
    assert proc.returncode == 0, output.read_text()[-4000:]
    return records(out)


def assert_close_params(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (torch.tensor(a[name]) - torch.tensor(b[name])).abs().max().item()
        assert diff <= tol, f"{name} differs by {diff}"


def loop_run(root: Path, **config) -> tuple[Path, object]:
    """ray_loop.train in Ray, EPOCHS epochs; its records and Ray's result."""
    from ray_loop import train

    out = root / "out"
    out.mkdir()
    return out, fit(train, {"out": str(out), "ray": True, "epochs": EPOCHS, **config}, root / "storage")


def ray_data_run(root: Path) -> tuple[Path, object]:
    """One worker group for both Ray Data tests: the loop on the dataset "loop" (2 epochs), then hf_backend.Trainer on
    the dataset "trainer" (tests/scripts/ray_loop.py: ray_data_jobs)."""
    from ray_loop import ray_data_jobs, samples, trainer_rows

    out = root / "out"
    out.mkdir()
    datasets = {"loop": ray.data.from_items(samples()), "trainer": ray.data.from_items(trainer_rows())}
    return out, fit(ray_data_jobs, {"out": str(out), "epochs": 2}, root / "storage", datasets=datasets)


def glue_run(root: Path, tiny, data: str) -> tuple[int, dict, Path]:
    """recipes/ray/run_glue_ray.py with `--data data`: its exit code, results.json and Ray's storage."""
    import run_glue_ray

    out, storage = root / "run", root / "ray"
    code = run_glue_ray.main([*recipe_args(tiny, out), "--storage_path", str(storage), "--num_workers", "2", "--data",
                              data])
    return code, json.loads((out / "results.json").read_text()), storage


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny, ray_cluster):
    """Every Ray run the selected tests read, started in this order, two at a time; name -> future of its result."""
    plan = {  # name: (the tests that read it, the run)
        "deepspeed": (["test_deepspeed_zero3_checkpoints_resume_inside_ray"],
                      lambda root: loop_run(root, crash_after=1, strategy="deepspeed")),
        "ddp": (["test_dataloader_path_matches_the_launcher_and_resumes_after_a_crash"],
                lambda root: loop_run(root, crash_after=1)),
        "fsdp": (["test_fsdp_sharded_checkpoints_resume_inside_ray"],
                 lambda root: loop_run(root, crash_after=2, strategy="fsdp")),
        "ray_data": (["test_ray_data_shards_are_not_split_again", "test_the_trainer_inside_ray_with_ray_data"],
                     ray_data_run),
        "glue_ray": (["test_the_glue_recipe_on_ray_both_data_paths"], lambda root: glue_run(root, tiny, "ray")),
        "glue_torch": (["test_the_glue_recipe_on_ray_both_data_paths"], lambda root: glue_run(root, tiny, "torch")),
    }
    if importlib.util.find_spec("deepspeed") is None:
        del plan["deepspeed"]  # its test skips
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray_run")
    futures = {name: pool.submit(run, tmp_path_factory.mktemp(name)) for name, (tests, run) in plan.items()
               if selected & set(tests)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)  # before the cluster goes


def test_ray_data_shards_are_not_split_again(runs):
    out, result = runs["ray_data"].result()
    assert result.error is None
    ranks = records(out)
    assert [r["world"] for r in ranks] == [2, 2]
    assert {r["batches_type"].split(".")[0] for r in ranks} == {"ray"}  # prepare() handed it back as it was
    for epoch in ("0", "1"):
        halves = [r["ids"][epoch] for r in ranks]
        assert [len(h) for h in halves] == [32, 32] and sorted(halves[0] + halves[1]) == list(range(64))
    assert ranks[0]["local_params"] == ranks[1]["local_params"]


def test_the_trainer_inside_ray_with_ray_data(runs):
    out, result = runs["ray_data"].result()
    assert result.error is None
    ranks = [json.loads((out / f"trainer_rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2] and {r["wrapped"] for r in ranks} == {"DistributedDataParallel"}
    assert [(r["steps"], r["rows"]) for r in ranks] == [(4, 32), (4, 32)]  # 64 rows: half to each, not split again
    assert ranks[0]["params"] == ranks[1]["params"]
    with result.checkpoint.as_directory() as directory:  # what Ray's RayTrainReportCallback reported (the last)
        assert (Path(directory) / "checkpoint" / "trainer_state.json").is_file()


def test_dataloader_path_matches_the_launcher_and_resumes_after_a_crash(launched, runs):
    out, result = runs["ddp"].result()
    assert result.error is None
    ranks = records(out)
    assert [r["world"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1] and {r["device"] for r in ranks} == {"cpu"}
    assert {r["distributed_type"] for r in ranks} == {"MULTI_CPU"}
    # The first attempt crashed after epoch 1; Ray restarted the workers, which restored that checkpoint.
    assert (out / "crashed").exists() and all(r["starts"] == [0, 1] and r["restored"] for r in ranks)
    for epoch in map(str, range(EPOCHS)):
        halves = [r["ids"][epoch] for r in ranks]
        assert [len(h) for h in halves] == [32, 32] and sorted(halves[0] + halves[1]) == list(range(64))
        assert halves == [launched[0]["ids"][epoch], launched[1]["ids"][epoch]]  # the same order as the launcher's
    assert ranks[0]["local_params"] == ranks[1]["local_params"]  # one model, synchronized
    assert_close_params(ranks[0]["full_params"], launched[0]["full_params"])
    # The last checkpoint Ray kept: the state (metadata, each rank's random state) and the model's weights.
    with result.checkpoint.as_directory() as directory:
        files = {p.name for p in Path(directory).iterdir()}
        assert {"hf_backend_checkpoint.json", "rng_state_0.pt", "rng_state_1.pt", "model"} <= files
        assert (Path(directory) / "model" / "model.safetensors").is_file()
    assert result.metrics["epoch"] == EPOCHS


def test_fsdp_sharded_checkpoints_resume_inside_ray(launched, runs):
    out, result = runs["fsdp"].result()
    assert result.error is None
    ranks = records(out)
    assert {r["distributed_type"] for r in ranks} == {"FSDP"} and all(r["starts"] == [0, 2] for r in ranks)
    with result.checkpoint.as_directory() as directory:
        shards = sorted(p.name for p in (Path(directory) / "model_dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # written by both ranks, merged by Ray
    assert_close_params(ranks[0]["full_params"], launched[0]["full_params"])


def test_deepspeed_zero3_checkpoints_resume_inside_ray(launched, runs):
    pytest.importorskip("deepspeed")
    out, result = runs["deepspeed"].result()
    assert result.error is None
    ranks = records(out)
    assert {r["distributed_type"] for r in ranks} == {"DEEPSPEED"} and all(r["starts"] == [0, 1] for r in ranks)
    with result.checkpoint.as_directory() as directory:
        names = {p.name for p in Path(directory).iterdir()}
    assert {"model.safetensors", "optimizer.bin"} <= names  # gathered from the ZeRO partitions by rank 0
    assert_close_params(ranks[0]["full_params"], launched[0]["full_params"], tol=1e-4)


def test_the_glue_recipe_on_ray_both_data_paths(runs):
    code, results, storage = runs["glue_ray"].result()
    assert code == 0
    assert results["world_size"] == 2 and set(results["metrics"]["dev"]) == {"accuracy", "f1"}
    # 64 rows, 32 a worker, batch 8: 4 steps an epoch, 2 epochs, a checkpoint (2 kept) reported after each
    assert [h["step"] for h in results["history"] if "loss" in h][-1] == 8
    kept = sorted((storage / "glue_mrpc_ray").glob("checkpoint_2*"))
    assert len(kept) == 2 and all((k / "hf_backend_checkpoint.json").is_file() for k in kept)

    code, results, _ = runs["glue_torch"].result()
    assert code == 0
    assert results["world_size"] == 2 and [h["step"] for h in results["history"] if "loss" in h][-1] == 8
