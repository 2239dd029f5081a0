"""Accelerate's everyday API beyond the training loop: the names scripts import, PartialState / AcceleratorState,
find_executable_batch_size, get_logger, triggers, join_uneven_inputs, state hooks, loader sizes and state, reduce,
unwrap_model, per-process save_state directories. One process in this interpreter; the checks where processes
interact share one 2-process job (tests/scripts/api_two_procs.py)."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from helpers import run_script
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from hf_backend import Accelerator, HfBackendError


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


# -- 1. names scripts import ------------------------------------------------------------------------------------------
def test_names_scripts_import_exist_and_enums_match_accelerate():
    import accelerate.utils

    from hf_backend import (  # noqa: F401
        DDPCommunicationHookType,
        DistributedType,
        LocalSGD,
        PartialState,
        ProfileKwargs,
        debug_launcher,
        find_executable_batch_size,
        notebook_launcher,
        skip_first_batches,
    )
    from hf_backend.utils import (  # noqa: F401
        ComputeEnvironment,
        LoggerType,
        PrecisionType,
        broadcast,
        gather_object,
        is_tensorboard_available,
        is_torch_xla_available,
        patch_environment,
        release_memory,
        set_seed,
        synchronize_rng_states,
        tqdm,
    )
    from hf_backend.utils import DistributedType as UtilsDistributedType

    assert UtilsDistributedType is DistributedType
    ours = {"DistributedType": DistributedType, "PrecisionType": PrecisionType, "LoggerType": LoggerType,
            "ComputeEnvironment": ComputeEnvironment}
    for name, enum in ours.items():
        theirs = {m.name: m.value for m in getattr(accelerate.utils, name)}
        have = {m.name: m.value for m in enum}
        missing = {k: v for k, v in theirs.items() if have.get(k) != v}
        assert not missing, f"{name} lacks (or has other values for) {missing}"
    assert "fp16" in PrecisionType and "bf16" in PrecisionType and "fp9" not in PrecisionType
    assert isinstance(is_torch_xla_available(), bool) and isinstance(is_tensorboard_available(), bool)
    assert Accelerator().distributed_type != DistributedType.XLA


def test_find_executable_batch_size_retries_smaller_batches_after_out_of_memory(monkeypatch):
    import gc

    from hf_backend import find_executable_batch_size

    collected = []  # memory is freed before each retry; a real gc.collect() costs 0.3 s in this interpreter
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    for oom, start, sizes in ((torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), 128,
                               [128, 115, 103, 92, 82, 73, 65, 58, 52, 46]),
                              (RuntimeError("CUDA out of memory."), 52, [52, 46])):
        seen = []

        @find_executable_batch_size(starting_batch_size=start)
        def train(batch_size, tag, oom=oom, seen=seen):
            seen.append(batch_size)
            if batch_size > 50:
                raise oom
            return batch_size, tag

        assert train("x") == (46, "x")
        assert seen == sizes
    assert len(collected) >= 11

    calls = []

    @find_executable_batch_size(starting_batch_size=64)
    def broken(batch_size):
        calls.append(batch_size)
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    assert calls == [64], "an error that is not out-of-memory propagates at once"

    @find_executable_batch_size(starting_batch_size=2)
    def never_fits(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(HfBackendError) as error:
        never_fits()
    assert "batch size" in _one_line(error)


def test_release_memory_returns_none_per_object():
    from hf_backend.utils import release_memory

    a, b = torch.ones(3), torch.nn.Linear(2, 2)
    assert release_memory(a, b) == [None, None]


def test_refused_names_fail_in_one_line():
    import hf_backend

    with pytest.raises(HfBackendError) as error:
        from hf_backend.utils import init_empty_weights  # noqa: F401
    assert "from_pretrained" in _one_line(error) and "device_map" in str(error.value)
    with pytest.raises(HfBackendError) as error:
        from hf_backend import big_modeling  # noqa: F401
    _one_line(error)
    with pytest.raises(ModuleNotFoundError):  # no import hook on the whole process to answer this form
        import hf_backend.big_modeling  # noqa: F401
    assert not any(type(finder).__module__.startswith("hf_backend") or getattr(finder, "__module__", "") == "hf_backend"
                   for finder in sys.meta_path)
    with pytest.raises(HfBackendError) as error:
        hf_backend.init_empty_weights  # noqa: B018
    assert "device_map" in _one_line(error)


def test_accelerator_refuses_megatron_in_one_line_and_accepts_rng_types():
    with pytest.raises(HfBackendError) as error:
        Accelerator(megatron_lm_plugin=object())
    assert "Megatron" in _one_line(error)
    Accelerator(rng_types=["torch"])


# -- 2. PartialState / AcceleratorState --------------------------------------------------------------------------------
def test_partial_state_members_in_one_process(capsys):
    from hf_backend import DistributedType, PartialState

    state = PartialState()
    assert (state.num_processes, state.process_index, state.is_main_process) == (1, 0, True)
    assert state.device == torch.device("cpu") and state.distributed_type == DistributedType.NO
    state.print("printed by the main process")
    assert capsys.readouterr().out == "printed by the main process\n"
    state.wait_for_everyone()
    ran = []
    with state.main_process_first() as value:
        ran.append("block")  # the only process is the main one: it runs the block at once, and once
    assert ran == ["block"] and value is None
    with pytest.raises(KeyError, match="from the block"), state.main_process_first():
        raise KeyError("from the block")  # an error in the block reaches the caller unchanged
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    assert state.on_main_process(lambda: "main")() == "main"
    assert state.on_process(process_index=1)(lambda: "one")() is None
    assert state.on_local_process(local_process_index=0)(lambda: "local")() == "local"
    assert callable(state.destroy_process_group)


def test_accelerator_state_follows_the_newest_accelerator(capsys):
    from hf_backend.state import AcceleratorState

    acc = Accelerator(mixed_precision="bf16")
    assert AcceleratorState().mixed_precision == "bf16"  # as in Accelerate: without touching accelerator.state first
    assert acc.state.mixed_precision == "bf16"
    acc.state.print("state print")
    acc.state.wait_for_everyone()
    assert capsys.readouterr().out == "state print\n"


# -- 3. state hooks ----------------------------------------------------------------------------------------------------
def _model_and_optimizer(acc: Accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_save_and_load_state_pre_hooks(tmp_path):
    acc = Accelerator()
    model, _ = _model_and_optimizer(acc)
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", list(models), len(weights), output_dir))
        weights.pop()  # the hook saves this model its own way

    def load_hook(models, input_dir):
        calls.append(("load", list(models), input_dir))
        models.pop()  # the hook loads this model its own way

    handle = acc.register_save_state_pre_hook(save_hook)
    acc.save_state(tmp_path / "hooked")
    assert calls == [("save", [model], 1, str(tmp_path / "hooked"))]
    assert not (tmp_path / "hooked" / "model.safetensors").exists()
    handle.remove()
    acc.save_state(tmp_path / "plain")
    assert (tmp_path / "plain" / "model.safetensors").is_file() and len(calls) == 1

    handle = acc.register_load_state_pre_hook(load_hook)
    with torch.no_grad():
        model.weight.fill_(7.0)
    acc.load_state(tmp_path / "hooked")
    assert calls[-1] == ("load", [model], str(tmp_path / "hooked"))
    assert bool((model.weight == 7.0).all())
    handle.remove()
    acc.load_state(tmp_path / "plain")
    assert len(calls) == 2 and not bool((model.weight == 7.0).any())


def test_load_hook_skips_a_model_the_checkpoint_holds(tmp_path):
    """A load hook that takes the model out (it loads it itself) of a checkpoint saved without hooks: Accelerate
    simply does not load that model."""
    acc = Accelerator()
    model, _ = _model_and_optimizer(acc)
    acc.save_state(tmp_path / "plain")
    acc.register_load_state_pre_hook(lambda models, input_dir: models.pop())
    with torch.no_grad():
        model.weight.fill_(7.0)
    acc.load_state(tmp_path / "plain")
    assert bool((model.weight == 7.0).all())


# -- 4. logging --------------------------------------------------------------------------------------------------------
def test_get_logger_in_one_process(caplog):
    from hf_backend.logging import get_logger

    Accelerator()
    logger = get_logger("hf_backend_api_test")
    with caplog.at_level(logging.INFO, logger="hf_backend_api_test"):
        logger.info("main only")
        logger.info("everyone", main_process_only=False)
        logger.info("in order", in_order=True)
        logger.warning_once("said once")
        logger.warning_once("said once")
    assert [r.getMessage() for r in caplog.records] == ["main only", "everyone", "in order", "said once"]


# -- 5. data -----------------------------------------------------------------------------------------------------------
def test_dataloader_configuration_fields_and_dicts():
    from hf_backend import DataLoaderConfiguration

    config = DataLoaderConfiguration(dispatch_batches=None, use_seedable_sampler=True, use_stateful_dataloader=True,
                                     non_blocking=False, data_seed=3)
    acc = Accelerator(dataloader_config=config)
    assert acc.use_stateful_dataloader is True and acc.use_seedable_sampler is True
    assert acc.non_blocking is False and acc.dispatch_batches is None and acc.dataloader_config.data_seed == 3
    acc = Accelerator(dataloader_config={"use_stateful_dataloader": True, "data_seed": 3})
    assert acc.use_stateful_dataloader is True and acc.dataloader_config.data_seed == 3
    with pytest.raises(HfBackendError) as error:
        Accelerator(dataloader_config={"use_statefull_dataloader": True})
    assert "use_statefull_dataloader" in _one_line(error)
    with pytest.raises(HfBackendError) as error:
        Accelerator(project_config="dir")
    assert "project_dir" in _one_line(error)


def test_prepared_loader_sizes_and_set_epoch():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=True))
    assert (loader.total_batch_size, loader.batch_size, loader.total_dataset_length) == (4, 4, 20)
    loader.set_epoch(3)
    assert loader.epoch == 3
    epoch3 = [b[0].tolist() for b in loader]
    loader.set_epoch(3)
    assert [b[0].tolist() for b in loader] == epoch3
    assert loader.epoch == 4


def test_stateful_loader_with_workers_resumes_at_the_next_batch():
    from hf_backend import DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    assert acc.use_stateful_dataloader

    def make():
        return acc.prepare(DataLoader(TensorDataset(torch.arange(40.0)), batch_size=4, shuffle=True, num_workers=2))

    loader = make()
    loader.set_epoch(1)
    full = [b[0].tolist() for b in loader]
    loader.set_epoch(1)
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    assert seen == full[:3] and rest == full[3:]


class ListIndexed(torch.utils.data.Dataset):
    """Read a whole batch at a time: `__getitem__` takes the list of indices a BatchSampler yields."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, indices):
        return torch.tensor(indices) * 10


def test_batch_sampler_as_sampler_in_one_process():
    acc = Accelerator()
    loader = DataLoader(ListIndexed(), sampler=BatchSampler(SequentialSampler(range(10)), 3, False), batch_size=None)
    loader = acc.prepare(loader)
    assert [b.tolist() for b in loader] == [[0, 10, 20], [30, 40, 50], [60, 70, 80], [90]]


# -- 6. reduce ---------------------------------------------------------------------------------------------------------
def test_reduce_in_one_process_and_a_bad_reduction():
    from hf_backend.utils import reduce

    acc = Accelerator()
    t = torch.tensor([1.0, 2.0])
    for reduction in ("max", "sum", "mean", "none"):
        assert acc.reduce(t, reduction).tolist() == [1.0, 2.0]
    assert reduce(t, "max").tolist() == [1.0, 2.0]
    with pytest.raises(HfBackendError) as error:
        acc.reduce(t, "maximum")
    assert "max" in _one_line(error)


# -- 7. unwrap_model ---------------------------------------------------------------------------------------------------
def test_unwrap_model_strips_data_parallel_and_torch_compile():
    from hf_backend.utils import extract_model_from_parallel

    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert acc.unwrap_model(torch.nn.DataParallel(model)) is model
    assert acc.unwrap_model(compiled) is model
    assert acc.unwrap_model(compiled, keep_torch_compile=True) is compiled
    assert extract_model_from_parallel(torch.nn.DataParallel(model)) is model
    assert extract_model_from_parallel(compiled) is compiled  # Accelerate's default keeps torch.compile
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


# -- the 2-process job -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    """Run tests/scripts/api_two_procs.py once in 2 processes: each rank's report (what it wrote before the end, if
    the job failed), the shared log, each rank's stdout, and the job's failure if any."""
    root = tmp_path_factory.mktemp("api_two")
    out = root / "r.json"
    failure, stdout = None, ["", ""]
    try:
        proc = run_script("api_two_procs.py", ["--out", str(out), "--ckpt-root", str(root / "ckpt")], nproc=2,
                          timeout=90)
        stdout = proc.stdout.split("[rank 1]\n")
    except pytest.fail.Exception as error:
        failure = str(error)
    reports = [root / f"r.json.rank{r}.json" for r in range(2)]
    ranks = [json.loads(p.read_text()) if p.exists() else {} for p in reports]
    log = (root / "r.log").read_text().splitlines() if (root / "r.log").exists() else []
    return {"ranks": ranks, "stdout": stdout, "log": log, "failure": failure}


def _checked(two: dict, name: str) -> list[dict]:
    results = []
    for rank, report in enumerate(two["ranks"]):
        if name not in report:
            pytest.fail(f"rank {rank} never finished the check {name}: {two['failure']}")
        result = report[name]
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result['traceback']}"
        results.append(result)
    return results


def test_two_processes_partial_state(two):
    r0, r1 = _checked(two, "partial_state")
    for rank, r in enumerate((r0, r1)):
        assert (r["num_processes"], r["process_index"], r["is_main_process"]) == (2, rank, rank == 0)
        assert r["device"] == "cpu" and r["distributed_type"] == "MULTI_CPU" and r["destroy_process_group"]
        assert r["on_process_1"] == r["on_process_1_decorator"] == r["on_local_process_1"] == (1 if rank else None)
        assert r["on_main_process"] == (0 if rank == 0 else None)
    assert r0["split"] == [1, 2] and r1["split"] == [3]
    assert r1["first_order"] == "01", "main_process_first: rank 0 runs the block before rank 1"
    _checked(two, "accelerator_state")
    out0, out1 = two["stdout"]
    assert "PARTIAL_STATE_PRINT from 0" in out0 and "ACCELERATOR_STATE_PRINT from 0" in out0
    assert "PRINT from 1" not in out0 + out1, "print: only the local main process prints"


def test_two_processes_tqdm_only_on_local_main(two):
    r0, r1 = _checked(two, "tqdm_bar")
    assert (r0["disable"], r1["disable"]) == (False, True)
    assert r0["items"] == r1["items"] == [0, 1, 2]


def test_two_processes_trigger_set_on_one_rank(two):
    for r in _checked(two, "triggers"):
        assert (r["first"], r["second"]) == (True, False)


def test_two_processes_on_process_runs_only_there(two):
    r0, r1 = _checked(two, "on_process")
    assert (r0["result"], r0["calls"]) == (None, [])
    assert (r1["result"], r1["calls"]) == ("ran", [1])


def test_two_processes_join_uneven_inputs(two):
    r0, r1 = _checked(two, "join_uneven_inputs")
    assert r0["ddp"] == "DistributedDataParallel"
    assert (r0["steps"], r1["steps"]) == (3, 2), "even_batches=False inside the block: rank 1 has one batch fewer"
    for r in (r0, r1):
        assert r["len_before"] == r["len_after"] == 3 and r["even_batches_after"] is True


def test_two_processes_trigger_sync_in_backward_under_no_sync(two):
    r0, r1 = _checked(two, "trigger_sync_in_backward")
    expected = [(a + b) / 2 for a, b in zip(r0["local"], r1["local"])]
    assert r0["grad"] == r1["grad"] == [expected]


def test_two_processes_get_logger(two):
    _checked(two, "logging_calls")
    log = two["log"]
    assert [line for line in log if "main-only" in line] == [line for line in log if "main-only from 0" in line]
    assert len([line for line in log if "main-only" in line]) == 1
    assert sum("everyone from 0" in line for line in log) == sum("everyone from 1" in line for line in log) == 1
    ordered = [line for line in log if "ordered from" in line]
    assert len(ordered) == 2 and "ordered from 0" in ordered[0] and "ordered from 1" in ordered[1]


def test_two_processes_loader_sizes(two):
    for r in _checked(two, "loader_sizes"):
        plain, split = r["split=False"], r["split=True"]
        assert (plain["total_batch_size"], plain["batch_size"], plain["total_dataset_length"]) == (8, 4, 20)
        assert (split["total_batch_size"], split["batch_size"], split["total_dataset_length"]) == (4, 2, 20)
        assert len(plain["first"]) == 4 and len(split["first"]) == 2


def test_two_processes_shard_a_batch_sampler_given_as_sampler(two):
    r0, r1 = _checked(two, "batch_sampler_as_sampler")
    items0 = [i for b in r0["batches"] for i in b]
    items1 = [i for b in r1["batches"] for i in b]
    assert r0["batches"] and r1["batches"] and all(len(b) == 3 for b in r0["batches"] + r1["batches"])
    assert not set(items0) & set(items1) and sorted(items0 + items1) == [10 * i for i in range(12)]


def test_two_processes_reduce(two):
    for rank, r in enumerate(_checked(two, "reduce")):
        assert r["max"] == r["utils_max"] == [2.0, 20.0]
        assert r["sum"] == [3.0, 30.0] and r["mean"] == [1.5, 15.0]
        assert r["none"] == [rank + 1.0, 10.0 * (rank + 1)]


def test_two_processes_save_state_into_a_directory_each(two):
    r0, r1 = _checked(two, "save_state_per_rank_dirs")
    assert {"hf_backend_checkpoint.json", "model.safetensors", "optimizer.bin", "rng_state_0.pt"} <= set(r0["files"])
    assert "rng_state_1.pt" in r1["files"]
    acc = Accelerator()  # rank 0's directory resumes in one process
    model, _ = _model_and_optimizer(acc)
    acc.load_state(r0["dir"])
    assert model.weight.tolist() == r0["weight"]


def test_gradient_accumulation_steps_can_be_set_as_in_accelerate():
    """automatic_gradient_accumulation.py sets it after choosing the batch size."""
    acc = Accelerator()
    acc.gradient_accumulation_steps = 4
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.num_steps == 4
    with pytest.raises(HfBackendError, match="must be an integer >= 1"):
        acc.gradient_accumulation_steps = 0


def test_which_process_has_one_answer_before_the_process_state(monkeypatch, capsys):
    """A process group set up by someone else, without torchrun's RANK (Ray, a user's own init_process_group): notes,
    Accelerate-style logging and trackers take the group's rank, so rank 1 stays quiet."""
    import types

    from hf_backend.core import notes, rank
    from hf_backend.logging import get_logger

    monkeypatch.delenv("RANK", raising=False)
    group = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 1,
                                  get_world_size=lambda: 2)
    monkeypatch.setitem(sys.modules, "torch.distributed", group)
    monkeypatch.setattr("hf_backend.runtime.process._STATE", None)
    assert (rank.process_index(), rank.num_processes(), rank.is_main_process()) == (1, 2, False)
    notes.note("a note only rank 0 prints")
    get_logger("which_process").warning("a warning only rank 0 prints")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(group, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    assert rank.is_main_process()


def test_patch_and_clear_environment_put_back_what_was_there(monkeypatch) -> None:
    """Accelerate's two environment blocks (one helper: core/environ.py): names upper-cased and values strings
    inside, and afterwards each variable as it was, unset where it was unset, even when the block failed."""
    from hf_backend.utils import clear_environment, patch_environment

    monkeypatch.setenv("HFB_KEPT", "before")
    monkeypatch.delenv("HFB_NEW", raising=False)
    with patch_environment(hfb_kept=1, hfb_new="x"):
        assert (os.environ["HFB_KEPT"], os.environ["HFB_NEW"]) == ("1", "x")
    assert os.environ["HFB_KEPT"] == "before" and "HFB_NEW" not in os.environ
    with pytest.raises(RuntimeError), clear_environment():
        assert "HFB_KEPT" not in os.environ and not os.environ
        os.environ["HFB_NEW"] = "set inside"
        raise RuntimeError
    assert os.environ["HFB_KEPT"] == "before" and "HFB_NEW" not in os.environ
