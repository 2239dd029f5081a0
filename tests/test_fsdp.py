"""FSDP2 through the engine, 2 gloo processes: parity with DDP, memory, the docs' plugin, sharded checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import BERT_LOOP, BERT_TRAIN, DOCS_FSDP_YAML, SCRIPTS, cli, relative_difference, run_report, run_script

from hf_backend import FullyShardedDataParallelPlugin, HfBackendError
from hf_backend.config.options import Handlers
from hf_backend.state import ProcessState
from hf_backend.strategies import FSDPStrategy
from hf_backend.training.precision import Precision

transformers = pytest.importorskip("transformers")
from bert_loop import CONFIG, data  # noqa: E402 - tests/scripts, on pytest's `pythonpath` (pyproject)

LOOP, TRAIN, _relative = BERT_LOOP, BERT_TRAIN, relative_difference


@pytest.fixture(scope="module")
def full_shard(tmp_path_factory) -> dict:
    return run_report(LOOP, tmp_path_factory.mktemp("fs") / "r.json", [*TRAIN, "--fsdp", "FULL_SHARD"], nproc=2)


def test_full_shard_matches_ddp_and_halves_per_rank_memory(bert_ddp, full_shard):
    assert bert_ddp["distributed_type"] == "MULTI_CPU" and full_shard["distributed_type"] == "FSDP"
    assert len(full_shard["losses"]) == 32
    assert _relative(full_shard["losses"], bert_ddp["losses"]) <= 1e-4
    # clipping must see the global norm, not a shard's
    assert abs(full_shard["grad_norm"] - bert_ddp["grad_norm"]) <= 1e-4 * bert_ddp["grad_norm"]
    for rank in (0, 1):
        for kind in ("bytes_params", "bytes_grads", "bytes_optim"):
            ratio = full_shard["per_rank"][rank][kind] / bert_ddp["per_rank"][rank][kind]
            assert ratio <= 0.55, f"rank {rank} {kind}: {ratio:.3f} of DDP's"


def test_reduce_scatters_overlap_backward_and_nothing_reads_one_early(bert_ddp, tmp_path):
    # Each reduce-scatter's output is NaN until waited for: the strategy leaves one running while the next block's
    # backward computes, and neither FSDP2 nor clipping nor the optimizer may see it before it completes.
    run = run_report(LOOP, tmp_path / "r.json", [*TRAIN, "--fsdp", "FULL_SHARD", "--deferred-reduce-scatter"],
                     nproc=2)
    assert run["reduce_scatters"]["left_running"] == run["reduce_scatters"]["issued"] > 0
    assert _relative(run["losses"], bert_ddp["losses"]) <= 1e-4
    assert abs(run["grad_norm"] - bert_ddp["grad_norm"]) <= 1e-4 * bert_ddp["grad_norm"]


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
def test_other_sharding_strategies_match_ddp(bert_ddp, tmp_path, strategy):
    # Ranks seeded differently: sync_module_states (on by default) starts every rank from rank 0's weights.
    run = run_report(LOOP, tmp_path / "r.json", [*TRAIN, "--fsdp", strategy, "--seed-per-rank"], nproc=2)
    assert run["distributed_type"] == "FSDP"
    assert _relative(run["losses"], bert_ddp["losses"]) <= 1e-4


def test_the_docs_plugin_trains_and_save_model_loads_with_from_pretrained(tmp_path):
    run = run_report(LOOP, tmp_path / "r.json", ["--docs-plugin", "--save-model", str(tmp_path / "model")], nproc=2)
    assert run["distributed_type"] == "FSDP"
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        logits = loaded(input_ids=data(4).tensors[0]).logits
    torch.testing.assert_close(logits, torch.tensor(run["logits"]))


def test_sharded_checkpoint_from_two_ranks_resumes_in_two_and_in_one(full_shard, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_report(LOOP, tmp_path / "a.json", [*TRAIN, "--fsdp", "FULL_SHARD", "--stop-after", "11",
                                                   "--checkpoint", ckpt], nproc=2)
    written = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "model_dcp" in written and "optimizer_dcp" in written and "model.safetensors" not in written
    two = run_report(LOOP, tmp_path / "b.json", [*TRAIN, "--fsdp", "FULL_SHARD", "--resume", "--checkpoint", ckpt],
                     nproc=2)
    assert _relative(first["losses"] + two["losses"], full_shard["losses"]) <= 1e-5
    # One process: the same global batch (4 x 2 ranks) and FSDP asked for, so it runs unsharded and reads the shards.
    one = run_report(LOOP, tmp_path / "c.json", ["--batch-size", "8", "--grad-accum", "2", "--epochs", "2",
                                                 "--fsdp", "FULL_SHARD", "--resume", "--checkpoint", ckpt])
    assert one["distributed_type"] == "NO"
    assert _relative(first["losses"] + one["losses"], full_shard["losses"]) <= 1e-5


def test_full_state_checkpoint_from_one_process_resumes_sharded_in_two(full_shard, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_report(LOOP, tmp_path / "a.json", ["--batch-size", "8", "--grad-accum", "2", "--epochs", "2",
                                                   "--stop-after", "11", "--checkpoint", ckpt])
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    two = run_report(LOOP, tmp_path / "b.json", [*TRAIN, "--fsdp", "FULL_SHARD", "--state-dict-type",
                                                 "FULL_STATE_DICT", "--resume", "--checkpoint", ckpt], nproc=2)
    assert _relative(first["losses"] + two["losses"], full_shard["losses"]) <= 1e-5


def test_the_docs_fsdp_yaml_trains_fsdp_through_the_launcher(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(DOCS_FSDP_YAML.replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    out = tmp_path / "r.json"
    proc = cli("launch", "--config_file", str(config), "--cpu", str(SCRIPTS / LOOP), "--out", str(out),
               HF_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["distributed_type"] == "FSDP"
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(rank["bytes_params"] <= 0.55 * full for rank in report["per_rank"])


def _strategy(**plugin) -> FSDPStrategy:
    state = ProcessState(torch.device("cpu"), 2, 0, 0, 2, "gloo")
    options = FullyShardedDataParallelPlugin(**plugin).resolved()
    return FSDPStrategy(state, Precision("no", state.device), Handlers(), options)


def test_a_wrong_layer_class_lists_the_models_block_classes(two_fake_processes):
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG))
    with pytest.raises(HfBackendError, match=r"T5Block not in the model; its block classes are .*BertLayer"):
        _strategy(transformer_cls_names_to_wrap="T5Block")._blocks(model)
    blocks = _strategy()._blocks(model)  # default: the model's _no_split_modules
    assert {type(b).__name__ for b in blocks} == set(model._no_split_modules)
    assert [type(b).__name__ for b in _strategy(transformer_cls_names_to_wrap="BertLayer")._blocks(model)] == [
        "BertLayer", "BertLayer"]


def test_fsdp1_options_map_onto_fsdp2():
    from torch.distributed.fsdp import ShardingStrategy

    options = FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).resolved()
    assert options.sharding_strategy == "SHARD_GRAD_OP" and options.reshard_after_forward is False
    assert FullyShardedDataParallelPlugin(sharding_strategy=1).resolved().reshard_after_forward is True
    with pytest.raises(HfBackendError, match="sharding_strategy='EVERYTHING' is not one of FULL_SHARD"):
        FullyShardedDataParallelPlugin(sharding_strategy="EVERYTHING").resolved()


def test_an_accelerate_plugin_object_is_read_by_its_fields():
    accelerate = pytest.importorskip("accelerate")
    theirs = accelerate.FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=False, state_dict_type="SHARDED_STATE_DICT",
        transformer_cls_names_to_wrap=["BertLayer"], auto_wrap_policy="transformer_based_wrap")
    options = FullyShardedDataParallelPlugin.from_object(theirs).resolved()
    assert options.reshard_after_forward is False and options.state_dict_type == "SHARDED_STATE_DICT"
    assert options.transformer_cls_names_to_wrap == "BertLayer"


def test_cpu_ram_efficient_loading_gives_meta_ranks_rank0s_weights(full_shard, tmp_path):
    run = run_report(LOOP, tmp_path / "r.json", [*TRAIN, "--fsdp", "FULL_SHARD", "--meta-elsewhere"], nproc=2)
    assert run["per_rank"][1]["param_bytes_before_prepare"] == 0, "rank 1 built its model on the meta device"
    assert run["per_rank"][0]["bytes_optim"] == run["per_rank"][1]["bytes_optim"] > 0
    assert run["losses"] == full_shard["losses"]


def test_cpu_ram_efficient_loading_with_from_pretrained(tmp_path):
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG)).save_pretrained(tmp_path / "m")
    args = ["--fsdp", "FULL_SHARD", "--from-pretrained", str(tmp_path / "m")]
    plain = run_report(LOOP, tmp_path / "a.json", args, nproc=2)
    efficient = run_report(LOOP, tmp_path / "b.json", [*args, "--meta-elsewhere"], nproc=2)
    # every rank's optimizer must hold the sharded parameters it was re-pointed to
    assert efficient["per_rank"][0]["bytes_optim"] == efficient["per_rank"][1]["bytes_optim"] > 0
    assert efficient["losses"] == plain["losses"]


def test_cpu_ram_efficient_loading_keeps_no_full_copy_on_any_rank(tmp_path):
    """bf16 weights mapped by from_pretrained, fp32 master shards: with the option no rank, rank 0 included, makes
    a private full copy at prepare (rank 0 used to upcast its whole model before sharding: 1.5x the fp32 model);
    the model is the same as without it (Llama's rotary buffers are not in the state dict: rank 0's are kept)."""
    from memory_measure import CONFIG as LLAMA

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    llama.save_pretrained(tmp_path / "m")
    runs = {}
    for efficient in (0, 1):
        run_script("loading_peak.py", ["--model", str(tmp_path / "m"), "--efficient", str(efficient),
                                       "--out", str(tmp_path / str(efficient))], nproc=2, timeout=300)
        runs[efficient] = [json.loads((tmp_path / str(efficient) / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(runs[1]):
        shard = report["full_fp32_bytes"] / 2
        allowed = shard + report["largest_fp32_bytes"] + 16 * 2**20  # the shard, one parameter in flight, slack
        assert report["peak_bytes"] <= allowed, (rank, report)
    assert runs[0][0]["peak_bytes"] > runs[0][0]["full_fp32_bytes"], "without the option rank 0 upcasts it all"
    assert [r["loss"] for r in runs[1]] == [r["loss"] for r in runs[0]]


def test_mixed_precision_policy_and_activation_checkpointing(tmp_path):
    out = tmp_path / "r.json"
    run_script("fsdp_options.py", [str(out)], nproc=2)
    seen = json.loads(out.read_text())
    assert seen["bf16_policy"]["param_dtype"] == "torch.float32"  # sharded master weights stay fp32
    assert seen["activation_checkpointing"]["checkpointed"] == 3  # one per wrapped block: embeddings + 2 layers
    # Recomputing activations changes nothing numerically.
    assert seen["activation_checkpointing"]["losses"] == seen["plain"]["losses"]
    # bf16 (the policy's parameters, or autocast) shows in every loss, which still tracks the same steps in fp32 within
    # a few bf16 roundings (its spacing near 0.69 is 0.004).
    reference = seen.pop("fp32")["losses"]
    for name, variant in seen.items():
        assert len(variant["losses"]) == len(reference) == 4 and variant["losses"] != reference, name
        assert max(abs(a - b) for a, b in zip(variant["losses"], reference)) <= 0.02, (name, variant, reference)
