"""Pipeline parallelism's stages and schedules (hf_backend/strategies/pipeline.py; issue 56's first part), against one
process: tests/scripts/pp_loop.py on pp 2 and pp 4, a tiny Llama and a tiny dense Qwen3 of 8 decoder layers, each
schedule 3 SGD steps with clipping, every step's loss and clipped norm and the parameters at the end within 1e-5 of
one process's on the same global batch; then the layout, the bubble and the one-line refusals."""

from __future__ import annotations

import pytest
from helpers import run_report

pytest.importorskip("transformers")

TOLERANCE = 1e-5
SCHEDULES = {2: ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
             4: ["GPipe", "1F1B", "Interleaved1F1B"]}
CASES = [(pp, model, schedule) for pp, names in SCHEDULES.items() for model in ("llama", "qwen3") for schedule in names]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    root, done = tmp_path_factory.mktemp("pp"), {}

    def report(pp: int) -> dict:
        if pp not in done:
            done[pp] = run_report("pp_loop.py", root / f"pp{pp}.json", ["--schedules", ",".join(SCHEDULES[pp])],
                                  nproc=pp, timeout=300)
        return done[pp]

    return report


@pytest.mark.parametrize(("pp", "model", "schedule"), CASES)
def test_a_schedule_trains_as_one_process(reports, pp, model, schedule) -> None:
    run = reports(pp)["runs"][f"{model}/{schedule}"]
    assert len(run["losses"]) == 3 and run["losses"] != [run["losses"][0]] * 3
    assert run["loss"] <= TOLERANCE, (run["losses"], run["reference"])
    assert run["norm"] <= TOLERANCE and run["params"] <= TOLERANCE, run
    assert run["parameters_held"] == run["parameters"]  # every parameter on exactly one rank
    stages = [rank["stages"] for rank in run["ranks"]]
    held = sorted(stage for ranks in stages for stage in ranks)
    assert held == list(range(run["ranks"][0]["num_stages"]))
    blocks = sorted(block for rank in run["ranks"] for part in rank["blocks"] for block in part)
    assert blocks == list(range(8))


def test_the_layout_splits_the_blocks_evenly_and_places_the_stages() -> None:
    from hf_backend.strategies.pipeline import layout

    assert layout("1F1B", 2, 1, 8) == (2, (1,), (range(0, 4), range(4, 8)))
    assert layout("GPipe", 3, 0, 8).blocks == (range(0, 2), range(2, 5), range(5, 8))  # the first stage embeds too
    assert layout("GPipe", 3, 0, 7).blocks == (range(0, 2), range(2, 5), range(5, 7))
    assert layout("Interleaved1F1B", 2, 0, 8).stages == (0, 2)
    assert layout("Interleaved1F1B", 2, 1, 12, stages_per_rank=3).stages == (1, 3, 5)
    assert layout("ZBVZeroBubble", 2, 0, 8).stages == (0, 3)  # V: the first and the last stage on rank 0
    assert layout("DualPipeV", 4, 1, 8).stages == (1, 6)


def test_the_bubble_of_each_schedule() -> None:
    from hf_backend.strategies.pipeline import bubble_fraction

    assert bubble_fraction("GPipe", 2, 4, 1) == bubble_fraction("1F1B", 2, 4, 1) == pytest.approx(1 / 5)
    assert bubble_fraction("1F1B", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("InterleavedZeroBubble", 2, 4, 2) == 0.0


def test_what_cannot_be_split_is_one_line() -> None:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    from hf_backend.core.errors import ConfigError
    from hf_backend.strategies.pipeline import check_splittable, layout

    with pytest.raises(ConfigError, match="needs at least 8 decoder layers; the model has 4"):
        layout("Interleaved1F1B", 4, 0, 4)
    with pytest.raises(ConfigError, match="pp_schedule='2F2B' is not one of"):
        layout("2F2B", 2, 0, 4)
    with pytest.raises(ConfigError, match="BertModel has no base_model_pp_plan"):
        check_splittable(BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=8)))
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="ties its embeddings to its head.*tie_word_embeddings=False"):
        check_splittable(tied)
