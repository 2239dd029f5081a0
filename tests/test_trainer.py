"""hf_backend.Trainer / TrainingArguments: the Transformers docs' example under every backend, parity with
transformers.Trainer, true losses under DDP, and resuming after a SIGKILL. Accelerate's Accelerator and process state
are made to raise in every hf_backend run (tests/scripts/trainer_docs.py)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI, DOCS_FSDP_YAML, OFFLINE, SCRIPTS, cli, cli_env, run_script

pytest.importorskip("datasets")

SCRIPT = "trainer_docs.py"
# Dropout off and a larger step for the cross-world-size comparisons (dropout masks depend on the batch split).
DDP_ARGS = ["--dropout", "0", "--lr", "1e-3", "--save-steps", "4"]
FSDP_JSON = {"fsdp_transformer_layer_cls_to_wrap": ["BertLayer"], "fsdp_backward_prefetch": "backward_pre",
             "fsdp_forward_prefetch": "false", "fsdp_sync_module_states": "true", "version": 2}


def run(tmp: Path, name: str, args: list[str], nproc: int = 1, expect_kill: bool = False,
        launcher: bool = False) -> dict | None:
    """Run the docs example in `nproc` processes (forked warm; through `hf-backend launch --cpu` with `launcher`);
    its report (None when the run is expected to be SIGKILLed by its --kill-after-checkpoint callback)."""
    out = tmp / f"{name}.json"
    args = ["--out", str(out), "--output-dir", str(tmp / name), *args]
    if launcher:
        proc = cli("launch", "--cpu", "--num_processes", str(nproc), str(SCRIPTS / SCRIPT), *args, timeout=300,
                   **OFFLINE)
        killed = proc.returncode != 0 and "was killed by SIGKILL" in proc.stderr
    else:
        proc = run_script(SCRIPT, args, nproc=nproc, timeout=300, check=False)
        killed = proc.returncode == -signal.SIGKILL
    if expect_kill:
        assert killed, proc.stderr[-3000:]
        return None
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def losses(report: dict, after: int = 0) -> list[float]:
    return [h["loss"] for h in report["log_history"] if "loss" in h and h["step"] > after]


def evals(report: dict) -> list[float]:
    """eval_loss and eval_accuracy of each evaluation, in order."""
    return [h[k] for h in report["log_history"] if "eval_loss" in h for k in ("eval_loss", "eval_accuracy")]


def relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def max_abs(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """hf_backend, one process, global batch 16: the reference of the 2-process runs."""
    return run(tmp_path_factory.mktemp("one"), "one", [*DDP_ARGS, "--batch-size", "16"])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("ddp"), "ddp", [*DDP_ARGS, "--batch-size", "8"], nproc=2)


def test_one_process_logs_what_transformers_trainer_logs(tmp_path):
    early = ["--early-stopping", "1", "--lr", "3e-3", "--epochs", "6"]  # stops when the eval loss first gets worse
    stock = run(tmp_path, "stock", ["--stock", *early])
    ours = run(tmp_path, "ours", [*early, "--report-to", "tensorboard"])
    assert list((tmp_path / "ours" / "runs").rglob("events.out.tfevents.*"))
    assert 1 < len(ours["checkpoints"]) < 6 and len(losses(ours)) == 8 * len(ours["checkpoints"])  # 16 steps an epoch
    assert relative(losses(ours), losses(stock)) <= 1e-5
    assert evals(ours) == pytest.approx(evals(stock), rel=1e-5)
    assert max_abs(ours["params"], stock["params"]) <= 1e-6
    assert ours["checkpoints"] == stock["checkpoints"] and Path(ours["best"]).name == Path(stock["best"]).name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_logs_what_transformers_trainer_logs(precision, tmp_path):
    """bf16 autocast matches exactly; fp16 (autocast plus a GradScaler) within 1e-4 (measured 1.7e-5)."""
    args = ["--precision", precision, "--lr", "1e-3", "--epochs", "1"]
    stock = run(tmp_path, "stock", ["--stock", *args])
    ours = run(tmp_path, "ours", args)
    assert relative(losses(ours), losses(stock)) <= (1e-6 if precision == "bf16" else 1e-4)


def test_ddp_logs_the_true_losses_of_the_global_batch(one_process, ddp):
    """transformers 5.23 under torchrun reports (and backpropagates) BERT's mean loss times the world size."""
    assert ddp["world_size"] == 2 and ddp["distributed_type"] == "MULTI_CPU"
    assert ddp["model_wrapped"] == "DistributedDataParallel"  # transformers 5.23 on CPU: not wrapped, unsynchronized
    assert relative(losses(ddp), losses(one_process)) <= 1e-5
    assert evals(ddp) == pytest.approx(evals(one_process), rel=1e-5)
    assert max_abs(ddp["params"], one_process["params"]) <= 1e-5


def test_gradient_accumulation_equals_the_larger_batch(one_process, tmp_path):
    """transformers divides BERT's mean loss by nothing under accumulation (it assumes the loss is already scaled)."""
    report = run(tmp_path, "accumulated", [*DDP_ARGS, "--batch-size", "8", "--grad-accum", "2"])
    assert relative(losses(report), losses(one_process)) <= 1e-5
    assert max_abs(report["params"], one_process["params"]) <= 1e-5


@pytest.mark.parametrize("kind", ["docs_yaml", "json", "plugin"])
def test_fsdp_config_as_the_docs_yaml_as_json_and_as_a_plugin(kind, ddp, tmp_path):
    if kind == "docs_yaml":
        config = tmp_path / "fsdp.yaml"
        config.write_text(DOCS_FSDP_YAML)  # SHARDED_STATE_DICT, FULL_SHARD, BertLayer, cpu_ram_efficient_loading
    elif kind == "json":
        config = tmp_path / "fsdp.json"
        config.write_text(json.dumps(FSDP_JSON))
    extra = ["--evaluate-first"] if kind == "json" else []  # the model is prepared for evaluation, then training
    report = run(tmp_path, kind, [*DDP_ARGS, "--batch-size", "8", *extra, "--fsdp-config",
                                  "plugin" if kind == "plugin" else str(config)], nproc=2,
                 launcher=kind == "docs_yaml")  # the docs' way: their YAML, through the launcher
    assert report["distributed_type"] == "FSDP"  # transformers 5.23 silently trains plain DDP with the JSON
    assert relative(losses(report), losses(ddp)) <= 1e-4
    assert max_abs(report["params"], ddp["params"]) <= 1e-4
    last = tmp_path / kind / report["checkpoints"][-1]
    assert (last / "model_dcp").is_dir() == (kind == "docs_yaml")  # sharded checkpoints under SHARDED_STATE_DICT
    assert (last / "trainer_state.json").is_file()


def test_deepspeed_config(ddp, tmp_path):
    """With save_only_model and load_best_model_at_end (which transformers refuses under DeepSpeed): the best
    checkpoint's weights are loaded at the end, as under DDP. A resumed ZeRO run: the SIGTERM tests below."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
    report = run(tmp_path, "ds", [*DDP_ARGS, "--batch-size", "8", "--deepspeed", str(config), "--save-only-model"],
                 nproc=2)
    assert report["distributed_type"] == "DEEPSPEED" and report["model_wrapped"] == "DeepSpeedEngine"
    assert relative(losses(report), losses(ddp)) <= 1e-4
    assert max_abs(report["params"], ddp["params"]) <= 1e-4
    files = {f.name for f in (tmp_path / "ds" / report["checkpoints"][-1]).iterdir()}
    assert {"model.safetensors", "dataloader.bin", "trainer_state.json"} <= files, files
    assert not {"optimizer.pt", "scheduler.pt"} & files and not any(f.startswith("global_step") for f in files)


def _kill_and_resume(tmp: Path, args: list[str], nproc: int, launcher: bool = False) -> dict:
    """SIGKILLed 2 steps after checkpoint-8 (through `hf-backend launch` with `launcher`), then resumed in forked
    processes (a launcher resuming a run: test_a_killed_trainer_restarts_by_itself_...)."""
    run(tmp, "run", [*args, "--kill-after-checkpoint", "8"], nproc=nproc, expect_kill=True, launcher=launcher)
    assert (tmp / "run" / "checkpoint-8" / "trainer_state.json").is_file()
    assert not (tmp / "run" / "checkpoint-12").exists()
    return run(tmp, "run", [*args, "--resume"], nproc=nproc)


def test_sigkill_then_resume_is_bitwise_in_one_process(tmp_path):
    args = ["--save-steps", "4", "--lr", "1e-3"]  # dropout on: the RNG must be restored too
    whole = run(tmp_path, "whole", args)
    resumed = _kill_and_resume(tmp_path, args, nproc=1)
    assert losses(resumed, after=8) == losses(whole, after=8)
    assert resumed["params"] == whole["params"]


def test_sigkill_then_resume_under_ddp(ddp, tmp_path):
    # with activation checkpointing (recomputation changes nothing without dropout)
    resumed = _kill_and_resume(tmp_path, [*DDP_ARGS, "--batch-size", "8", "--activation-checkpointing"], nproc=2,
                               launcher=True)  # as a user would: the launcher names the killed rank
    assert relative(losses(resumed, after=8), losses(ddp, after=8)) <= 1e-6
    assert max_abs(resumed["params"], ddp["params"]) <= 1e-6


def test_a_killed_trainer_restarts_by_itself_and_resumes_the_newest_checkpoint(ddp, tmp_path):
    """`launch --max_restarts 1` and `train(resume_from_checkpoint=True)`: the first start has no checkpoint and
    trains from the beginning; both processes are SIGKILLed 2 steps after checkpoint-8; the restart resumes it."""
    args = [*DDP_ARGS, "--batch-size", "8", "--kill-after-checkpoint", "8", "--resume"]
    out = tmp_path / "run.json"
    proc = cli("launch", "--cpu", "--num_processes", "2", "--max_restarts", "1", str(SCRIPTS / SCRIPT), "--out",
               str(out), "--output-dir", str(tmp_path / "run"), *args, timeout=300, **OFFLINE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no complete checkpoint" in proc.stderr and "(exitcode: -9)" in proc.stderr  # fresh start, then killed
    resumed = json.loads(out.read_text())
    assert resumed["global_step"] == ddp["global_step"] and resumed["adam_steps"] == ddp["adam_steps"]
    assert relative(losses(resumed, after=8), losses(ddp, after=8)) <= 1e-6
    assert max_abs(resumed["params"], ddp["params"]) <= 1e-6


def test_sigkill_then_resume_under_fsdp_from_sharded_checkpoints(ddp, tmp_path):
    from safetensors.torch import load_file

    args = [*DDP_ARGS, "--batch-size", "8", "--fsdp-config", "plugin", "--state-dict-type", "SHARDED_STATE_DICT",
            "--save-final"]
    resumed = _kill_and_resume(tmp_path, args, nproc=2)
    assert (tmp_path / "run" / resumed["checkpoints"][-1] / "model_dcp").is_dir()
    # the user's save_model(): full weights from the main process only (transformers before 5.23 wrote from each)
    saved = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert [float(x) for _, v in sorted(saved.items()) for x in v.float().flatten()] == resumed["params"]
    # the uninterrupted run: FSDP trains what DDP trains (test_fsdp_config_as_the_docs_yaml_... above)
    assert relative(losses(resumed, after=8), losses(ddp, after=8)) <= 1e-5
    assert max_abs(resumed["params"], ddp["params"]) <= 1e-5


# -- construction: one-line errors before any training ----------------------------------------------------------------
def _arguments(tmp_path: Path, **kwargs):
    from hf_backend import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)


def test_contradictions_and_bad_options_fail_at_construction(tmp_path):
    from hf_backend import HfBackendError

    cases = [
        (dict(fsdp="full_shard", deepspeed={"zero_optimization": {"stage": 2}}),
         "TrainingArguments: fsdp and deepspeed are both set; keep one of them"),
        (dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrapp": ["BertLayer"]}),
         "fsdp_config: unknown key 'transformer_layer_cls_to_wrapp'; did you mean 'transformer_layer_cls_to_wrap'?"),
        (dict(fsdp="shard_grad_op", fsdp_config={"sharding_strategy": "FULL_SHARD"}),
         "fsdp='shard_grad_op' contradicts fsdp_config's sharding_strategy='FULL_SHARD'; keep one"),
        (dict(fsdp_config=str(tmp_path / "missing.yaml")),
         f"{tmp_path / 'missing.yaml'}: no such config file; create one with `hf-backend config` or fix the path"),
    ]
    for kwargs, message in cases:
        with pytest.raises(HfBackendError) as err:
            _arguments(tmp_path, **kwargs)
        assert str(err.value) == message


def test_push_to_hub_without_a_reachable_hub_fails_at_construction(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from hf_backend import HfBackendError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HfBackendError) as err:
        _arguments(tmp_path, push_to_hub=True)
    assert str(err.value) == ("push_to_hub=True but HF_HUB_OFFLINE is set; set push_to_hub=False (save_model() "
                              "writes the model locally; push it later)")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(HfBackendError, match=r"^push_to_hub=True but the Hub at https://127.0.0.1:9 is not reachable"):
        _arguments(tmp_path, push_to_hub=True)


def test_the_docs_yaml_becomes_the_fsdp_options_in_effect(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(DOCS_FSDP_YAML)
    args = _arguments(tmp_path, fsdp="full_shard", fsdp_config=str(config))
    plugin = args.fsdp_plugin
    assert (plugin.sharding_strategy, plugin.state_dict_type, plugin.transformer_cls_names_to_wrap) == \
        ("FULL_SHARD", "SHARDED_STATE_DICT", "BertLayer")
    assert args.fsdp_config["cpu_ram_efficient_loading"] is True and args.to_json_string()
    assert args.fsdp_plugin is args.fsdp_options  # one value, shown under Accelerate's name
    assert args.fsdp is False  # one process: transformers' Trainer would refuse FSDP; the engine trains unsharded


def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path):
    from hf_backend import HfBackendError
    from hf_backend.trainer import last_complete_checkpoint

    for step, complete in ((4, True), (8, True), (12, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-8")
    with pytest.raises(HfBackendError, match="no complete checkpoint-"):
        last_complete_checkpoint(str(tmp_path / "empty"))
    assert last_complete_checkpoint(str(tmp_path / "empty"), none_ok=True) is None  # under torch elastic


def test_with_no_backend_argument_the_launchers_choice_applies(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "FSDP")
    monkeypatch.setenv("HF_BACKEND_FSDP_CONFIG", json.dumps({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}))
    assert _arguments(tmp_path).fsdp_plugin.sharding_strategy == "SHARD_GRAD_OP"
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "DEEPSPEED")
    monkeypatch.setenv("HF_BACKEND_DEEPSPEED_CONFIG", json.dumps({"zero_stage": 3}))
    args = _arguments(tmp_path, per_device_train_batch_size=4)
    assert args.fsdp_plugin is None and args.deepspeed_plugin.config()["zero_optimization"]["stage"] == 3
    assert args.hf_deepspeed_config.config["train_micro_batch_size_per_gpu"] == 4  # "auto", filled by transformers


# -- checkpoints both ways: ours resume under transformers.Trainer, and transformers' under ours ---------------------
STEPS = 32  # 256 rows, a global batch of 16, 2 epochs


def _checkpoint_4(tmp: Path, writer: list[str], args: list[str], nproc: int) -> Path:
    """`writer` trains until 2 steps after saving checkpoint-4 and is SIGKILLed: checkpoint-4 is the newest."""
    run(tmp, "run", [*writer, *args, "--kill-after-checkpoint", "4"], nproc=nproc, expect_kill=True)
    checkpoint = tmp / "run" / "checkpoint-4"
    assert (checkpoint / "trainer_state.json").is_file() and not (tmp / "run" / "checkpoint-8").exists()
    return checkpoint


def _resume(tmp: Path, checkpoint: Path, name: str, reader: list[str], args: list[str], nproc: int) -> dict:
    """`reader` resumes from a copy of `checkpoint` (the newest complete one in its output directory)."""
    shutil.copytree(checkpoint, tmp / name / checkpoint.name)
    return run(tmp, name, [*reader, *args, "--resume"], nproc=nproc)


@pytest.fixture(scope="module")
def ours_checkpoint_4(tmp_path_factory) -> Path:
    """Ours in one process, global batch 16: its checkpoint-4 (read by two tests; _resume resumes a copy)."""
    return _checkpoint_4(tmp_path_factory.mktemp("ours_one"), [], [*DDP_ARGS, "--batch-size", "16"], 1)


@pytest.fixture(scope="module")
def ours_ddp_checkpoint_4(tmp_path_factory) -> Path:
    """Ours under DDP (2 processes of batch 8): its checkpoint-4 (read by two tests; _resume resumes a copy)."""
    return _checkpoint_4(tmp_path_factory.mktemp("ours_ddp"), [], [*DDP_ARGS, "--batch-size", "8"], 2)


def test_ours_writes_transformers_file_names(ours_checkpoint_4):
    files = {p.name for p in ours_checkpoint_4.iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "model.safetensors", "rng_state.pth", "trainer_state.json",
            "hf_backend_checkpoint.json", "dataloader.bin"} <= files, files
    assert not files & {"optimizer.bin", "scheduler.bin"}


@pytest.fixture(scope="module")
def stock_one_process(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("stock"), "stock", ["--stock", *DDP_ARGS, "--batch-size", "16"])


def test_transformers_resumes_ours_in_one_process(one_process, stock_one_process, ours_checkpoint_4, tmp_path):
    args = [*DDP_ARGS, "--batch-size", "16"]
    resumed = _resume(tmp_path, ours_checkpoint_4, "stock", ["--stock"], args, 1)
    assert resumed["adam_steps"] == one_process["adam_steps"] == STEPS  # the optimizer state came back
    assert relative(losses(resumed, after=4), losses(stock_one_process, after=4)) <= 1e-5
    assert max_abs(resumed["params"], stock_one_process["params"]) <= 1e-5


def test_ours_resumes_transformers_in_one_process(one_process, tmp_path):
    args = [*DDP_ARGS, "--batch-size", "16"]
    resumed = _resume(tmp_path, _checkpoint_4(tmp_path, ["--stock"], args, 1), "ours", [], args, 1)
    assert resumed["adam_steps"] == STEPS
    assert relative(losses(resumed, after=4), losses(one_process, after=4)) <= 1e-5
    assert max_abs(resumed["params"], one_process["params"]) <= 1e-5


def test_both_ways_under_ddp(ours_ddp_checkpoint_4, tmp_path):
    """transformers 5.23 under DDP backpropagates BERT's mean loss times the world size (test_trainer.py), so its
    runs are no reference for ours after the checkpoint; it must resume our checkpoint with the optimizer restored
    (Adam has taken every step, the 4 before the checkpoint too). Ours resumes its checkpoint in 2 processes and
    trains what one process with the global batch trains from it."""
    from hf_backend.trainer.transformers_compat import STOCK_TRAINER_RESUMES_UNDER_CPU_DDP

    args = [*DDP_ARGS, "--batch-size", "8"]
    if STOCK_TRAINER_RESUMES_UNDER_CPU_DDP:  # transformers 5.17's own Trainer cannot (transformers_compat.py)
        stock = _resume(tmp_path, ours_ddp_checkpoint_4, "stock_resumed", ["--stock"], args, 2)
        assert (stock["distributed_type"], stock["model_wrapped"]) == ("MULTI_CPU", "DistributedDataParallel")
        assert stock["adam_steps"] == stock["global_step"] == STEPS
        assert [h["step"] for h in stock["log_history"] if "loss" in h] == list(range(2, STEPS + 1, 2))  # on from 4

    stock_written = _checkpoint_4(tmp_path / "stock", ["--stock"], args, 2)
    two = _resume(tmp_path, stock_written, "ours_2", [], args, 2)
    one = _resume(tmp_path, stock_written, "ours_1", [], [*DDP_ARGS, "--batch-size", "16"], 1)
    assert two["adam_steps"] == one["adam_steps"] == STEPS
    assert relative(losses(two, after=4), losses(one, after=4)) <= 1e-5
    assert max_abs(two["params"], one["params"]) <= 1e-5


def test_a_ddp_checkpoint_resumes_under_fsdp(ddp, ours_ddp_checkpoint_4, tmp_path):
    """transformers' optimizer.pt (numbered parameters) from DDP, sharded onto FSDP2's parameters on resume."""
    args = [*DDP_ARGS, "--batch-size", "8"]
    resumed = _resume(tmp_path, ours_ddp_checkpoint_4, "fsdp", [], [*args, "--fsdp-config", "plugin"], 2)
    assert resumed["model_wrapped"] != "DistributedDataParallel" and resumed["adam_steps"] == STEPS
    assert relative(losses(resumed, after=4), losses(ddp, after=4)) <= 1e-5
    assert max_abs(resumed["params"], ddp["params"]) <= 1e-5


# -- enable_jit_checkpoint: SIGTERM saves one checkpoint on every rank, then the run resumes ------------------------
def _backend(strategy: str, tmp: Path) -> list[str]:
    if strategy == "fsdp":
        return ["--fsdp-config", "plugin"]
    if strategy == "deepspeed":
        config = tmp / "ds.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
        return ["--deepspeed", str(config)]
    return []


def _resumes_to_the_uninterrupted_run(tmp: Path, args: list[str], saved: int, ddp: dict) -> None:
    resumed = run(tmp, "run", [*args, "--resume"], nproc=2)
    after = saved + saved % 2  # losses are logged every 2 steps: the first whole window after the resume
    assert relative(losses(resumed, after=after), losses(ddp, after=after)) <= 1e-4
    assert max_abs(resumed["params"], ddp["params"]) <= 1e-4


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_the_launcher_saves_a_checkpoint_and_the_run_resumes(strategy, ddp, tmp_path):
    """As a scheduler stops a job: SIGTERM to `hf-backend launch`, which passes it to its workers. A run that stops
    before step 9 has its ranks' stacks printed by the hang watch (60 s), well within the 240 s the test waits."""
    args = [*DDP_ARGS, "--batch-size", "8", "--jit-checkpoint", *_backend(strategy, tmp_path)]
    out_dir = tmp_path / "run"
    command = [*CLI, "launch", "--cpu", "--num_processes", "2", "--hang_timeout", "60", str(SCRIPTS / SCRIPT),
               "--out", str(tmp_path / "first.json"), "--output-dir", str(out_dir), *args, "--slow-after", "9"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=cli_env(**OFFLINE))
    deadline = time.monotonic() + 240
    while not (out_dir / "reached").is_file() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    reached = (out_dir / "reached").is_file()
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    # pytest.fail: the whole output, which an assertion's message would shorten
    if not reached:
        pytest.fail(f"the run did not reach step 9 (exit code {launcher.returncode}):\n{stderr}")
    announced = re.findall(r"SIGTERM: saving checkpoint-(\d+)", stderr)
    saved = sorted(int(p.name.split("-")[1]) for p in out_dir.glob("checkpoint-*"))
    if not announced or not saved or saved[-1] != int(announced[-1]) or saved[-1] < 9:
        pytest.fail(f"the SIGTERM checkpoint is missing (checkpoints {saved}):\n{stderr}")
    assert (out_dir / f"checkpoint-{saved[-1]}" / "trainer_state.json").is_file()
    _resumes_to_the_uninterrupted_run(tmp_path, args, saved[-1], ddp)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_checkpoint(strategy, ddp, tmp_path):
    """A preemption notice to one process: transformers' callback would save on that process alone (the others train
    on, and the save's collectives hang); here every process saves the same step and stops."""
    args = [*DDP_ARGS, "--batch-size", "8", "--jit-checkpoint", *_backend(strategy, tmp_path)]
    first = run(tmp_path, "run", [*args, "--slow-after", "9", "--sigterm-rank", "1"], nproc=2)
    assert first["checkpoints"][-1] == "checkpoint-9" and first["global_step"] == 9
    _resumes_to_the_uninterrupted_run(tmp_path, args, 9, ddp)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torch_compile_wraps_the_strategys_model(strategy, ddp, tmp_path):
    """torch_compile=True compiles the prepared model (around DDP / FSDP2) once; it trains what DDP trains. The
    eager backend captures the same graphs as inductor and runs them without generating code (seconds, not
    minutes)."""
    backend = _backend(strategy, tmp_path)
    report = run(tmp_path, strategy, [*DDP_ARGS, "--batch-size", "8", "--torch-compile", "eager", *backend],
                 nproc=2)
    assert report["compiled"]
    assert relative(losses(report), losses(ddp)) <= 1e-4
    assert max_abs(report["params"], ddp["params"]) <= 1e-4


def test_ignore_data_skip_restarts_the_epoch_as_transformers_does(tmp_path):
    args = ["--save-steps", "4", "--lr", "1e-3", "--ignore-data-skip"]
    stock = _kill_and_resume(tmp_path / "stock", ["--stock", *args], nproc=1)
    ours = _kill_and_resume(tmp_path / "ours", args, nproc=1)
    assert relative(losses(ours, after=8), losses(stock, after=8)) <= 1e-5
    assert max_abs(ours["params"], stock["params"]) <= 1e-5


@pytest.mark.parametrize("kind", ["all", "non_padding"])
def test_num_input_tokens_seen_counts_every_process(kind, tmp_path):
    """Summed over the processes, as transformers does ("all" counts the padding each process's batch got)."""
    args = [*DDP_ARGS, "--tokens-seen", kind, "--epochs", "1", "--batch-size", "8"]
    stock = run(tmp_path, "stock", ["--stock", *args], nproc=2)
    ours = run(tmp_path, "ours", args, nproc=2)

    def seen(report: dict) -> list[int]:
        return [h["num_input_tokens_seen"] for h in report["log_history"] if "num_input_tokens_seen" in h]

    assert seen(ours) == seen(stock) and seen(ours)[-1] > 0
