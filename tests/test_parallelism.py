"""N-D parallelism on one DeviceMesh (issues 33, 44): tensor parallelism from a Llama's tp_plan, context parallelism,
Ulysses sequence parallelism, FSDP / HSDP over the data-parallel dimensions, and their combinations, against one
process on the same global batch.

tests/scripts/nd_loop.py trains a tiny Llama 4 steps on 8 sequences a step (split_batches), with clipping at 0.5,
once with SGD and once with AdamW, on each grid (dp_replicate x dp_shard x tp [x cp [x sp]]); where the sequences are
split and nothing else divides the batch, AdamW again on padded, left-padded and packed batches with unevenly spread
targets. Each run's AdamW pass also saves a checkpoint after step 2, and every grid of the saving set (one process,
tp 2, dp_shard 2 x tp 2, HSDP 2 x 2, FSDP 2, ZeRO-3 2, cp 2, sp 2) resumes every other one's checkpoint: the
continued losses must equal the uninterrupted run's.
tests/scripts/llm_trainer.py runs hf_backend.Trainer on the same grids (padded sequences of uneven lengths),
tests/scripts/tp_pretrained.py a model from_pretrained(tp_plan="auto") sharded; then the launcher's flags,
consolidate, and the one-line refusals.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import run_report

pytest.importorskip("transformers")

SCRIPT = "nd_loop.py"
# grid -> processes; the saving set: one process, tp 2, dp_shard 2 x tp 2, HSDP 2 x 2, FSDP 2, ZeRO-3 2, cp 2, sp 2
GRIDS = {"single": 1, "1x1x2": 2, "1x2x2": 4, "2x2x1": 4, "fsdp": 2, "zero3": 2, "1x1x1x2": 2, "1x1x1x1x2": 2}
# the sp grids: sp 2, sp 2 x dp_shard 2, sp 2 x tp 2, sp 4; cp 4 (a ring of 4); HSDP 2 x 2 x cp 2 (8 processes)
EQUIVALENCE = ["1x1x2", "1x2x2", "2x2x1", "2x2x2", "1x1x1x2", "1x2x1x2", "1x1x2x2", "1x1x1x4", "2x2x1x2",
               "1x1x1x1x2", "1x2x1x1x2", "1x1x2x1x2", "1x1x1x1x4"]
# where cp or sp splits the sequences and nothing else divides the batch: padded and packed batches too
LAYOUTS = ["padded", "left", "packed"]
SPLIT_ONLY = ["1x1x1x2", "1x1x2x2", "1x1x1x1x2", "1x1x2x1x2"]
LOSS, SGD_PARAMS, ADAMW_PARAMS, NORM = 1e-6, 1e-6, 5e-5, 1e-5
# after AdamW's first step (about the sign of each gradient element) the losses part by more: cp 2's padded run was
# 1.19e-6 from one process's at step 2 on an AVX2-only CPU (AMD EPYC, 2026-12-03), 5 ulps of a loss of 3.75
ADAMW_LOSS = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each grid's uninterrupted SGD and AdamW runs, the AdamW one saving after step 2 (once per module)."""
    root = tmp_path_factory.mktemp("grids")
    done: dict[str, dict] = {}

    def run(grid: str) -> dict:
        if grid not in done:
            if grid == "zero3":
                pytest.importorskip("deepspeed")
            nproc = GRIDS.get(grid) or math.prod(map(int, grid.split("x")))
            optimizers = "adamw" if grid in ("fsdp", "zero3") else "sgd,adamw"  # those two only save here
            layouts = ",".join(["full", *LAYOUTS]) if grid == "single" or grid in SPLIT_ONLY else "full"
            report = run_report(SCRIPT, root / f"{grid}.json",
                                ["--grid", grid, "--optimizers", optimizers, "--checkpoint", str(root / grid),
                                 "--layouts", layouts], nproc=nproc, timeout=300)
            done[grid] = {**report, "checkpoint": root / grid}
        return done[grid]

    return run


def _largest(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _steps(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and all(math.isfinite(x) for x in [*a, *b])
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("grid", EQUIVALENCE)
def test_a_grid_trains_as_one_process(runs, grid):
    """Per-step loss within 1e-6 with SGD and 1e-5 with AdamW, the clipped norm within 1e-5, the parameters within
    1e-6 after SGD and 5e-5 after AdamW; the batches are split over the data-parallel ranks only."""
    one, many = runs("single"), runs(grid)
    replicate, shard = map(int, grid.split("x")[:2])
    if grid in SPLIT_ONLY:
        for layout in LAYOUTS:  # the loss is the mean over the whole sequences however the targets fall
            a, b = one["runs"][f"adamw/{layout}"], many["runs"][f"adamw/{layout}"]
            assert _steps(a["losses"], b["losses"]) <= ADAMW_LOSS, (layout, a["losses"], b["losses"])
            assert _steps(a["norms"], b["norms"]) <= NORM, layout
            assert _largest(a["params"], b["params"]) <= ADAMW_PARAMS, layout
    assert many["data_parallel"] == replicate * shard
    for optimizer, loss, tolerance in (("sgd", LOSS, SGD_PARAMS), ("adamw", ADAMW_LOSS, ADAMW_PARAMS)):
        a, b = one["runs"][optimizer], many["runs"][optimizer]
        assert len(a["losses"]) == 4
        assert _steps(a["losses"], b["losses"]) <= loss, (optimizer, a["losses"], b["losses"])
        assert _steps(a["norms"], b["norms"]) <= NORM, (optimizer, a["norms"], b["norms"])
        assert a["norms"][0] > 0.5  # the clipping (at 0.5) acted
        assert _largest(a["params"], b["params"]) <= tolerance, optimizer


@pytest.mark.parametrize("target", list(GRIDS))
def test_every_grid_resumes_every_other_grids_checkpoint(runs, target, tmp_path):
    """Saved after step 2 on grid A, resumed on grid B: steps 3 and 4 equal the uninterrupted run's (1e-5), and
    the parameters at the end the uninterrupted AdamW run's (5e-5)."""
    sources = [grid for grid in GRIDS if grid != target]
    checkpoints = [str(runs(grid)["checkpoint"]) for grid in sources]
    nproc = GRIDS[target]
    report = run_report(SCRIPT, tmp_path / "resumed.json", ["--grid", target, "--resume", ",".join(checkpoints)],
                        nproc=nproc, timeout=300)
    reference = runs("single")["runs"]["adamw"]
    for source, checkpoint in zip(sources, checkpoints):
        resumed = report["runs"][checkpoint]
        assert _steps(resumed["losses"], reference["losses"][2:]) <= ADAMW_LOSS, (source, target)
        assert _largest(resumed["params"], reference["params"]) <= ADAMW_PARAMS, (source, target)


@pytest.fixture(scope="module")
def trainer_alone(tmp_path_factory) -> dict:
    """hf_backend.Trainer in one process on the global batch of 8: the reference of the Trainer cases."""
    root = tmp_path_factory.mktemp("trainer_alone")
    return run_report("llm_trainer.py", root / "one.json", ["--output-dir", str(root / "one"), "--batch-size", "8",
                                                            *TRAINER])


TRAINER = ["--steps", "4", "--save-steps", "10", "--pad-multiple", "8"]  # widths divisible by 2 x cp (4) and sp


@pytest.mark.parametrize("grid", EQUIVALENCE)
def test_the_trainer_trains_on_a_grid_as_one_process(trainer_alone, grid, tmp_path):
    """hf_backend.Trainer with TrainingArguments(parallelism_config=...) on each grid, on padded sequences of uneven
    lengths (transformers counts the items of the global batch once, not tp or cp times; under cp it passes the
    slices through maybe_context_parallel): the logged losses within 1e-6, the gradient norms within 1e-5, the
    parameters within 5e-5 of one process on the same global batch (each data-parallel rank reads 8 / dp)."""
    one = trainer_alone
    sizes = [*map(int, grid.split("x")), 1][:5]
    per_rank = 8 // (sizes[0] * sizes[1])
    many = run_report("llm_trainer.py", tmp_path / "grid.json",
                      ["--output-dir", str(tmp_path / "grid"), "--batch-size", str(per_rank), "--grid", grid,
                       *TRAINER], nproc=math.prod(sizes))
    assert many["world_size"] == math.prod(sizes) and len(one["losses"]) == 4
    # the loss by chunks (training/chunked_loss.py) at every step, but under tp (its head's vocabulary is sharded)
    assert one["chunked"] == [True] * 4 and many["chunked"] == [sizes[2] == 1] * 4
    assert _steps(one["losses"], many["losses"]) <= LOSS
    assert _steps(one["grad_norms"], many["grad_norms"]) <= NORM
    assert max(abs(x - y) for x, y in zip(one["params"], many["params"], strict=True)) <= ADAMW_PARAMS


# -- one line for what cannot run -------------------------------------------------------------------------------------


class _Mesh:
    """What apply_tensor_parallel asks of a mesh before it shards anything."""

    def size(self) -> int:
        return 2


def _llama(**config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                                           "num_hidden_layers": 1, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, **config}))


def test_a_model_without_a_tp_plan_is_refused_in_one_line():
    from transformers import BertConfig, BertForSequenceClassification

    from hf_backend import HfBackendError
    from hf_backend.strategies.tensor_parallel import apply_tensor_parallel

    bert = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=32))
    with pytest.raises(HfBackendError, match=r"^tensor parallelism: BertForSequenceClassification has no tp_plan "
                                             r"\(BERT and GPT-2 have none\); set tp_size=1") as error:
        apply_tensor_parallel(bert, _Mesh())
    assert "\n" not in str(error.value)


def test_a_plan_that_does_not_split_the_heads_is_refused_in_one_line():
    from hf_backend import HfBackendError
    from hf_backend.strategies.tensor_parallel import apply_tensor_parallel

    with pytest.raises(HfBackendError, match=r"^tensor parallelism: LlamaForCausalLM has num_key_value_heads=1, "
                                             r"which does not "
                                             r"split over tp_size=2"):
        apply_tensor_parallel(_llama(num_key_value_heads=1), _Mesh())


def test_the_plan_has_full_module_paths():
    from hf_backend.strategies.tensor_parallel import tp_plan

    plan = tp_plan(_llama())
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"


@pytest.mark.parametrize(("config", "world", "message"), [
    ({"tp_size": 2}, 4, r"^ParallelismConfig: tp_size 2 makes 2 processes, but 4 run; set dp_shard_size=2 or "
                        r"launch 2 processes$"),
    ({"tp_size": 2, "dp_shard_size": 2}, 3, r"^ParallelismConfig: dp_shard_size 2 x tp_size 2 makes 4 processes, "
                                            r"but 3 run; launch 4 processes$"),
    ({"tp_size": 0}, 2, r"^ParallelismConfig tp_size=0 must be an integer >= 1$"),
    ({"sp_size": 2, "cp_size": 2}, 4, r"^ParallelismConfig cp_size=2 with sp_size=2: a sequence is split by one of "
                                      r"them; set cp_size=1 or sp_size=1$"),
    ({"sp_size": 2, "sp_backend": "ring"}, 2, r"^ParallelismConfig sp_backend='ring': use 'deepspeed' or "
                                              r"'hf_backend' \(both run hf_backend's Ulysses\)$"),
    ({"cp_backend": "ring"}, 2, r"^ParallelismConfig cp_backend='ring': the one backend is 'torch'$"),
    ({"tp_sizes": 2}, 2, r"^parallelism_config: unknown key 'tp_sizes'; the keys are dp_replicate_size, "),
])
def test_a_grid_that_does_not_fit_is_one_line(config, world, message):
    from hf_backend import HfBackendError
    from hf_backend.parallel.config import ParallelismConfig

    with pytest.raises(HfBackendError, match=message):
        ParallelismConfig.of(config).shape(world)


def test_sizes_come_from_accelerates_variables(monkeypatch):
    """`accelerate launch --parallelism_config_tp_size 2` and `hf-backend launch` hand the sizes over the same way."""
    from hf_backend.parallel.config import requested_shape
    from hf_backend.parallel.dims import MeshShape

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    assert requested_shape(None, 4) == MeshShape(dp_shard=2, tp=2)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")
    assert requested_shape(None, 4) is None


def test_accelerates_parallelism_config_is_read_by_its_fields():
    from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig

    from hf_backend.parallel.config import ParallelismConfig
    from hf_backend.parallel.dims import MeshShape

    ours = ParallelismConfig.of(AccelerateConfig(dp_shard_size=2, tp_size=2))
    assert ours.shape(4) == MeshShape(dp_shard=2, tp=2)
    assert ParallelismConfig().shape(4) == MeshShape(dp_replicate=4)  # empty: data parallel, as Accelerate
    assert not MeshShape(dp_replicate=4).needs_mesh and MeshShape(tp=2).needs_mesh


def test_the_launchers_flags_lay_out_every_process(runs, tmp_path):
    """`hf-backend launch --parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2` (Accelerate's flags)
    hands the grid to Accelerator() in each of the 4 processes, which then trains as one process does."""
    from helpers import SCRIPTS, cli

    out = tmp_path / "launched.json"
    proc = cli("launch", "--cpu", "--num_processes", "4", "--parallelism_config_dp_shard_size", "2",
               "--parallelism_config_tp_size", "2", str(SCRIPTS / SCRIPT), "--grid", "launched", "--out", str(out),
               "--optimizers", "sgd", HF_HOME=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["grid"]["tp_size"] == 2 and report["grid"]["dp_shard_size"] == 2 and report["data_parallel"] == 2
    assert _steps(report["runs"]["sgd"]["losses"], runs("single")["runs"]["sgd"]["losses"]) <= LOSS


@pytest.mark.parametrize(("shape", "deepspeed", "message"), [
    ({"dp_shard": 2, "tp": 2}, True, r"^parallelism_config with DeepSpeed: DeepSpeed takes sequence parallelism alone "
                                     r"\(sp_size with sp_backend='deepspeed', its ALST\); hf_backend applies tensor, "
                                     r"context, expert and its own sequence parallelism on its native path; drop "
                                     r"deepspeed \(shard with dp_shard_size\) or those sizes$"),
    ({"sp": 2}, True, r"^parallelism_config with DeepSpeed: "),  # sp_backend "hf_backend": not DeepSpeed's
    ({"sp": 2, "tp": 2, "sp_backend": "deepspeed"}, True, r"^parallelism_config with DeepSpeed: "),
])
def test_what_the_mesh_path_does_not_run_is_one_line(shape, deepspeed, message):
    from hf_backend import DeepSpeedPlugin, HfBackendError
    from hf_backend.config.backend import DATA_PARALLEL, DEEPSPEED, Backend
    from hf_backend.config.options import Handlers
    from hf_backend.parallel.dims import MeshShape
    from hf_backend.state import ProcessState
    from hf_backend.strategies import select_strategy
    from hf_backend.training.precision import Precision

    process = ProcessState(torch.device("cpu"), 4, 0, 0, 4, "gloo")
    backend = Backend(DEEPSPEED, deepspeed=DeepSpeedPlugin()) if deepspeed else Backend(DATA_PARALLEL)
    with pytest.raises(HfBackendError, match=message):
        select_strategy(process, Precision("no", process.device), Handlers(), backend, shape=MeshShape(**shape))


def test_a_model_sharded_on_a_mesh_of_its_own_is_refused(two_fake_processes):
    """What `from_pretrained(..., tp_plan="auto")` hands over when tp_size is not the world size: parameters that
    are DTensors on a mesh of transformers' own, which cannot join the run's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hf_backend import HfBackendError
    from hf_backend.config.fsdp import FsdpOptions
    from hf_backend.config.options import Handlers
    from hf_backend.parallel.dims import MeshShape
    from hf_backend.strategies import FSDPStrategy
    from hf_backend.training.precision import Precision

    process = two_fake_processes
    strategy = FSDPStrategy(process, Precision("no", process.device), Handlers(), FsdpOptions(),
                            MeshShape(tp=2))
    model = torch.nn.Linear(4, 4)
    own = init_device_mesh("cpu", (2,), mesh_dim_names=("transformers_tp",))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), own, [Replicate()]))
    with pytest.raises(HfBackendError, match=r"^prepare\(\): the model was sharded by from_pretrained\(tp_plan=...\) "
                                             r"over a mesh that is not this run's tensor-parallel dimension"):
        strategy.setup_model(model)


def test_cpu_ram_efficient_loading_of_a_model_sharded_by_from_pretrained_is_refused(
        two_fake_processes):
    """Rank 0 has no full weights to send when from_pretrained(tp_plan=...) already split them."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_backend import HfBackendError
    from hf_backend.config.fsdp import FsdpOptions
    from hf_backend.config.options import Handlers
    from hf_backend.parallel.dims import MeshShape
    from hf_backend.strategies import FSDPStrategy
    from hf_backend.training.precision import Precision

    process = two_fake_processes
    strategy = FSDPStrategy(process, Precision("no", process.device), Handlers(),
                            FsdpOptions(cpu_ram_efficient_loading=True), MeshShape(tp=2))
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), strategy.mesh["tp"], [Shard(0)]))
    with pytest.raises(HfBackendError, match=r"^prepare\(\): cpu_ram_efficient_loading needs rank 0's full weights, "
                                             r"and this model was split across processes by from_pretrained"):
        strategy.setup_model(model)


class _SequenceMesh:
    """What a SequenceSplit asks of its mesh before it runs a collective."""

    def get_group(self) -> None:
        return None

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


@pytest.mark.parametrize("kind", ["cp", "sp"])
def test_what_a_sequence_split_cannot_take_is_one_line(kind):
    from transformers import BertConfig, BertModel

    from hf_backend import HfBackendError
    from hf_backend.strategies import context_parallel, ulysses
    from hf_backend.strategies.sequences import SequenceSplit

    module = context_parallel if kind == "cp" else ulysses
    split = SequenceSplit(_SequenceMesh(), kind, module.attention, module.NAME, balanced=kind == "cp")
    what = "context parallelism" if kind == "cp" else "sequence parallelism"
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(HfBackendError, match=rf"^{what}: BertModel has non-causal attention; {kind} splits "
                                             rf"the sequences of causal LMs only: set {kind}_size=1$"):
        split.apply(bert)
    with pytest.raises(HfBackendError, match=rf"^{what}: LlamaForCausalLM uses sliding-window attention"):
        split.apply(_llama(sliding_window=8, use_sliding_window=True))
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(HfBackendError, match=rf"^{what}: call the model inside accelerator\."
                                             r"maybe_context_parallel\(buffers="):
        split._before_forward(None, (), {"input_ids": ids})
    split.active = True
    with pytest.raises(HfBackendError, match=rf"^{what}: pass position_ids"):
        split._before_forward(None, (), {"input_ids": ids})
    with pytest.raises(HfBackendError, match=rf"^{what}: a 4-D attention_mask is not supported; pass a 2-D padding "
                                             r"mask, or none with packed position_ids$"):
        split._before_forward(None, (), {"position_ids": ids, "attention_mask": torch.ones(1, 1, 4, 4)})
    with pytest.raises(HfBackendError, match=rf"^{what}: labels without shift_labels: each slice would lose the "
                                             r"target of its last token; pass shift_labels"):
        split._before_forward(None, (), {"position_ids": ids, "labels": ids})
    chunks = " in 2 x 2 balanced chunks; pad the batches to a multiple of 4" if kind == "cp" else \
        "; pad the batches to a multiple of 2"
    with pytest.raises(HfBackendError, match=rf"^{what}: a sequence of 5 tokens does not split over "
                                             rf"{kind}_size=2{chunks} \(pad_to_multiple_of\)$"), \
            split.split([torch.ones(1, 5)], [1], []):
        pass


def test_heads_that_sequence_parallelism_cannot_split_are_one_line():
    from hf_backend import HfBackendError
    from hf_backend.strategies.ulysses import check_heads

    check_heads(_llama(), tp=2, sp=2)  # 4 heads: 2 per tp rank, 1 per sp rank
    with pytest.raises(HfBackendError, match=r"^sequence parallelism: LlamaForCausalLM has 4 attention heads "
                                             r"\(2 per tp rank\), which do not split over sp_size=4; choose an "
                                             r"sp_size that divides them$"):
        check_heads(_llama(), tp=2, sp=4)
    with pytest.raises(HfBackendError, match=r"^sequence parallelism: LlamaForCausalLM has 4 attention heads, "
                                             r"which do not split over sp_size=3"):
        check_heads(_llama(), tp=1, sp=3)


def test_gather_for_metrics_under_context_parallelism_is_refused():
    from hf_backend import HfBackendError
    from hf_backend.parallel.dims import DataShard
    from hf_backend.runtime.collectives import gather_for_metrics

    with pytest.raises(HfBackendError, match=r"^gather_for_metrics with the sequences split over 2 ranks \(cp_size "
                                             r"or sp_size\): each rank holds a slice of every sequence; evaluate "
                                             r"with cp_size=1 and sp_size=1$"):
        gather_for_metrics(torch.ones(2), None, shard=DataShard(2, 0, 2, True, 2))


def test_a_model_transformers_sharded_is_taken_as_it_is(tmp_path):
    """`from_pretrained(..., tp_plan="auto")` in 2 processes with tp_size=2: transformers' mesh is the run's
    tensor-parallel dimension, so prepare keeps its sharding (and its TP forward); the losses are one process's."""
    from nd_loop import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "model")
    model = ["--model", str(tmp_path / "model")]
    one = run_report("tp_pretrained.py", tmp_path / "one.json", model)
    grid = run_report("tp_pretrained.py", tmp_path / "grid.json", [*model, "--grid", "1x2"], nproc=2)
    assert len(one["losses"]) == 3 and _steps(one["losses"], grid["losses"]) <= LOSS
    # hf_backend.Trainer takes the grid from the model (tp_size 2), as transformers' Trainer does
    one = run_report("tp_pretrained.py", tmp_path / "trainer_one.json", [*model, "--trainer"])
    grid = run_report("tp_pretrained.py", tmp_path / "trainer_grid.json", [*model, "--grid", "1x2", "--trainer"],
                      nproc=2)
    assert grid["tp_size"] == 2 and len(one["losses"]) == 3 and _steps(one["losses"], grid["losses"]) <= LOSS


def test_consolidate_exports_a_tensor_parallel_checkpoint_for_from_pretrained(runs, tmp_path):
    """`hf-backend checkpoint consolidate` of dp_shard 2 x tp 2's DCP shards (FSDP's _StridedShard over TP's Shard)
    writes safetensors that `from_pretrained` loads: the weights one process's checkpoint holds at the same step."""
    from helpers import cli
    from nd_loop import tiny_llama
    from transformers import LlamaForCausalLM

    tiny_llama().config.save_pretrained(tmp_path / "config")
    loaded = {}
    for grid in ("single", "1x2x2"):
        proc = cli("checkpoint", "consolidate", str(runs(grid)["checkpoint"]), str(tmp_path / grid),
                   "--config", str(tmp_path / "config"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        loaded[grid] = LlamaForCausalLM.from_pretrained(tmp_path / grid).state_dict()
    assert loaded["single"].keys() == loaded["1x2x2"].keys()
    assert max(float((loaded["single"][k] - loaded["1x2x2"][k]).abs().max()) for k in loaded["single"]) <= ADAMW_PARAMS
