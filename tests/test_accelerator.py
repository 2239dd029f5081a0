"""The Accelerator in one process: state, settings, precision, accumulation, misuse, saving."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from hf_backend import Accelerator, DistributedType, HfBackendError, ProjectConfiguration
from hf_backend.training.optim import AcceleratedOptimizer, AcceleratedScheduler
from hf_backend.utils import set_seed


def _setup(acc: Accelerator, n: int = 32, batch: int = 4):
    set_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(n, 6), torch.randint(0, 2, (n,))), batch_size=batch)
    return acc.prepare(model, opt, loader, sched)


def test_one_process_state():
    acc = Accelerator()
    assert acc.num_processes == 1 and acc.process_index == 0 and acc.is_main_process and acc.is_local_main_process
    assert acc.distributed_type is DistributedType.NO and acc.device == torch.device("cpu")
    assert acc.mixed_precision == "no" and acc.gradient_accumulation_steps == 1
    ran = []
    with acc.main_process_first() as first, acc.local_main_process_first() as local_first:
        ran.append("block")  # the only process is the main and the local main one: it runs the block, once
    assert ran == ["block"] and first is None and local_first is None
    for context in (acc.main_process_first, acc.local_main_process_first):
        with pytest.raises(KeyError, match="from the block"), context():
            raise KeyError("from the block")  # an error in the block reaches the caller unchanged
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def test_the_device_a_launcher_names_is_used(monkeypatch):
    """Ray Train names each worker's device in ACCELERATE_TORCH_DEVICE (as Accelerate reads it); cpu=True wins."""
    from hf_backend.runtime.process import _pick_device

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "meta")  # any device torch knows; meta exists on every machine
    assert _pick_device(cpu=False, local_rank=1) == torch.device("meta")
    assert _pick_device(cpu=True, local_rank=1) == torch.device("cpu")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "gpu0")
    with pytest.raises(HfBackendError, match="ACCELERATE_TORCH_DEVICE='gpu0' is not a torch device"):
        _pick_device(cpu=False, local_rank=0)


def test_prepare_keeps_order_and_never_wraps_twice():
    acc = Accelerator()
    model, opt, loader, sched = _setup(acc)
    assert isinstance(opt, AcceleratedOptimizer) and isinstance(sched, AcceleratedScheduler)
    assert acc.prepare(model) is model and acc.prepare(opt) is opt and acc.prepare(loader) is loader
    other = object()
    assert acc.prepare(other) is other


def test_launcher_environment_is_read_and_an_explicit_argument_wins(monkeypatch, caplog):
    monkeypatch.setenv("HF_BACKEND_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("HF_BACKEND_GRADIENT_ACCUMULATION_STEPS", "4")
    acc = Accelerator()
    assert acc.mixed_precision == "bf16" and acc.gradient_accumulation_steps == 4
    acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    assert acc.mixed_precision == "no" and acc.gradient_accumulation_steps == 2
    assert "mixed_precision='no' given to Accelerator() overrides the launcher's HF_BACKEND_MIXED_PRECISION=bf16" in (
        caplog.text
    )


def test_bad_settings_are_one_line_errors(monkeypatch):
    with pytest.raises(HfBackendError, match="mixed_precision='fp8' is not one of no, fp16, bf16"):
        Accelerator(mixed_precision="fp8")
    with pytest.raises(HfBackendError, match="does not support gradient_acumulation_steps"):
        Accelerator(gradient_acumulation_steps=2)
    monkeypatch.setenv("HF_BACKEND_GRADIENT_ACCUMULATION_STEPS", "two")
    with pytest.raises(HfBackendError, match="HF_BACKEND_GRADIENT_ACCUMULATION_STEPS='two'"):
        Accelerator()


def test_backward_before_prepare_names_the_fix():
    acc = Accelerator()
    loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
    with pytest.raises(HfBackendError, match=r"call model, optimizer, \.\.\. = accelerator.prepare"):
        acc.backward(loss)


def test_accumulation_syncs_every_n_steps_and_at_the_end_of_the_loader():
    acc = Accelerator(gradient_accumulation_steps=3)
    model, opt, loader, sched = _setup(acc, n=20, batch=4)  # 5 batches: sync after 3, then at the end
    syncs, lrs = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        syncs.append(acc.sync_gradients)
        lrs.append(sched.get_last_lr()[0])
    assert syncs == [False, False, True, False, True]
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025], "the scheduler advances on optimizer steps only"


def test_backward_divides_by_the_accumulation_steps():
    grads = []
    for steps in (1, 2):
        acc = Accelerator(gradient_accumulation_steps=steps)
        model, opt, loader, _ = _setup(acc)
        x, y = next(iter(loader))
        acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        grads.append(model.weight.grad.clone())
    torch.testing.assert_close(grads[1] * 2, grads[0])


def test_bf16_autocast_on_cpu_returns_fp32_outputs():
    acc = Accelerator(mixed_precision="bf16")
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = self.lin(x)
            seen["dtype"] = out.dtype
            return out

    model = acc.prepare(Probe())
    out = model(torch.randn(2, 4))
    assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.randn(2, 4))
    assert seen["dtype"] == torch.float32


def test_fp16_scaler_skips_a_step_with_inf_gradients():
    acc = Accelerator(mixed_precision="fp16")
    model, opt, loader, sched = _setup(acc)
    x, y = next(iter(loader))
    before = model.weight.detach().clone()
    acc.backward(torch.nn.functional.cross_entropy(model(x), y) * float("inf"))
    opt.step()
    assert acc.optimizer_step_was_skipped
    torch.testing.assert_close(model.weight, before)
    opt.zero_grad()
    acc.backward(torch.nn.functional.cross_entropy(model(x), y))
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert not acc.optimizer_step_was_skipped and torch.isfinite(norm)
    assert not torch.equal(model.weight, before)


def test_gather_for_metrics_in_one_process_returns_every_row():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(torch.arange(10), batch_size=4))
    rows = torch.cat([acc.gather_for_metrics(b) for b in loader])
    assert rows.tolist() == list(range(10))
    assert acc.gather_for_metrics({"a": torch.tensor(1.0)})["a"].shape == (1,)
    assert acc.gather_for_metrics(["x", "y"], use_gather_object=True) == ["x", "y"]


def test_save_model_is_sharded_and_loads_back(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    acc.save_model(model, tmp_path / "out", max_shard_size="10KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        merged.update(load_file(tmp_path / "out" / shard))
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    fresh.load_state_dict(merged)  # strict: every key present, nothing extra
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_save_model_then_from_pretrained_for_a_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    acc = Accelerator()
    model = acc.prepare(transformers.BertForMaskedLM(config))  # tied input/output embeddings
    acc.save_model(model, tmp_path / "bert")
    assert (tmp_path / "bert" / "config.json").is_file(), "from_pretrained needs config.json"
    loaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "bert")
    ids = torch.randint(0, 64, (2, 10))
    model.eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_automatic_checkpoint_naming_rotates_and_load_picks_the_newest(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    model, opt, loader, sched = _setup(acc)
    paths = [acc.save_state() for _ in range(3)]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"] and paths[-1].endswith("checkpoint_2")
    with torch.no_grad():
        model.weight.zero_()
    fresh = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                            automatic_checkpoint_naming=True))
    m2, *_ = _setup(fresh)
    fresh.load_state()
    assert fresh.save_iteration == 3
    assert not torch.equal(m2.weight, torch.zeros_like(m2.weight))


def test_load_state_misuse_is_named(tmp_path):
    acc = Accelerator()
    _setup(acc)
    with pytest.raises(HfBackendError, match="no checkpoint directory at"):
        acc.load_state(tmp_path / "missing")
    with pytest.raises(HfBackendError, match="is not an hf_backend checkpoint"):
        acc.load_state(tmp_path)
    acc.save_state(tmp_path / "ck")
    other = Accelerator()
    other.prepare(torch.nn.Linear(6, 2))
    with pytest.raises(HfBackendError, match="holds 1 optimizers but 0 are prepared"):
        other.load_state(tmp_path / "ck")
    with pytest.raises(HfBackendError, match="lack state_dict"):
        acc.register_for_checkpointing(object())


def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    acc = Accelerator()
    model, *_ = _setup(acc)
    acc.save_state(tmp_path / "ck")
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(OSError):
        acc.save_state(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before


def test_engine_runs_with_accelerate_unimportable(tmp_path):
    out = tmp_path / "r.json"
    code = (
        "import sys, runpy\n"
        "sys.modules['accelerate'] = None  # any import of accelerate now raises ImportError\n"
        f"sys.argv = ['tutorial_loop.py', '--out', {str(out)!r}, '--epochs', '1']\n"
        f"runpy.run_path({str(SCRIPTS / 'tutorial_loop.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["eval_rows"] == 37


def test_the_launch_config_reaches_the_accelerator(monkeypatch, caplog):
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "MULTI_CPU")
    monkeypatch.setenv("HF_BACKEND_MIXED_PRECISION", "bf16")
    acc = Accelerator()
    assert acc.launch_config.distributed_type == "MULTI_CPU" and acc.launch_config.mixed_precision == "bf16"
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "FSDP")
    monkeypatch.setenv("HF_BACKEND_FSDP_CONFIG", '{"fsdp_transformer_layer_cls_to_wrap": "BertLayer"}')
    acc = Accelerator()  # one process: FSDP runs unsharded, and says so
    assert acc.distributed_type is DistributedType.NO
    assert "FSDP asked for in a single process: training unsharded" in caplog.text
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "DEEPSPEED")
    monkeypatch.setenv("HF_BACKEND_DEEPSPEED_CONFIG", '{"zero_stage": 3}')
    assert Accelerator().distributed_type is DistributedType.NO
    assert "DeepSpeed asked for in a single process" in caplog.text
    monkeypatch.setenv("HF_BACKEND_DISTRIBUTED_TYPE", "FSDP")
    monkeypatch.setenv("HF_BACKEND_FSDP_CONFIG", "{not json")
    with pytest.raises(HfBackendError, match="HF_BACKEND_FSDP_CONFIG is not JSON"):
        Accelerator()


def test_dynamo_backend_compiles_the_prepared_model_and_trains_the_same():
    from hf_backend.utils import TorchDynamoPlugin, is_compiled_module

    def train(**kwargs) -> tuple[torch.nn.Module, Accelerator, list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        acc = Accelerator(**kwargs)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for x in data:
            loss = model(x).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return model, acc, losses

    compiled, acc, losses = train(dynamo_backend="eager")
    assert is_compiled_module(compiled) and not is_compiled_module(acc.unwrap_model(compiled))
    assert train(dynamo_plugin=TorchDynamoPlugin(backend="eager"))[2] == losses == train()[2]
    # by regions: a model without repeated blocks is one region, compiled in place (no wrapper)
    regional, acc, regional_losses = train(dynamo_plugin={"backend": "eager", "use_regional_compilation": True})
    assert regional_losses == losses and not is_compiled_module(regional) and regional._compiled_call_impl is not None


def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 1))
    acc.save_state(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "hf_backend_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format_version"] == 3
    for version in (4, 0):
        meta_path.write_text(json.dumps({**meta, "format_version": version}))
        with pytest.raises(HfBackendError, match=rf"has format_version {version}; this hf_backend reads formats 2 and "
                                                 "3: load it with the hf_backend that wrote it, or upgrade"):
            acc.load_state(tmp_path / "ckpt")
    for version in ("2", True, None):
        meta_path.write_text(json.dumps({**meta, "format_version": version}))
        with pytest.raises(HfBackendError, match="has no valid 'format_version'; the checkpoint is damaged"):
            acc.load_state(tmp_path / "ckpt")
    meta_path.write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(HfBackendError, match="is a format-1 checkpoint .written by an hf_backend before 2026-11-27.; "
                                             "this hf_backend reads formats 2 and 3: load it with the hf_backend that"):
        acc.load_state(tmp_path / "ckpt")
    meta_path.write_text(json.dumps({**meta, "format_version": 3}))
    acc.load_state(tmp_path / "ckpt")
    assert model.weight.shape == (1, 2)


def test_init_method_other_than_env_is_an_error_not_ignored():
    from hf_backend import InitProcessGroupKwargs

    assert InitProcessGroupKwargs(init_method="env://").init_method == "env://"
    with pytest.raises(HfBackendError, match=r"^InitProcessGroupKwargs\(init_method='tcp://127.0.0.1:1'\): "):
        InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1")
