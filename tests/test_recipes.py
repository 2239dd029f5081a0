"""The GLUE recipes: seconds-long smoke runs of both flavours (a tiny BERT built from a config, a few steps) so they
cannot rot, their data reader's one-line errors, and the metric module against known values.

`python recipe.py ...` runs in a process forked from the suite's warm interpreter (tests/warm_processes.py: the script
runs as `python` would run it, without importing torch and transformers again); the loop recipe's first run goes
through `hf-backend launch`, as its docs say."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from helpers import HEADER, OFFLINE, cli, mrpc_rows, recipe_args, run_script

pytest.importorskip("evaluate")
RECIPES = Path(__file__).parent.parent / "recipes" / "glue"
import glue_data  # noqa: E402 - recipes/glue, on the path through pyproject's pytest `pythonpath`


def _python(script: str, *args: str, nproc: int = 1):
    """`python recipes/glue/<script> args` (offline), or the same under torchrun's environment in `nproc` processes."""
    return run_script(RECIPES / script, list(args), nproc=nproc, check=False)


def test_trainer_recipe_smoke_run(tiny, tmp_path):
    out = tmp_path / "run"
    proc = _python("run_glue.py", *recipe_args(tiny, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "mrpc" and results["world_size"] == 1 and results["flavour"] == "hf_backend.Trainer"
    assert set(results["metrics"]["dev"]) >= {"accuracy", "f1"} and results["train_samples_per_second"] > 0
    assert results["args"]["lr"] == 5e-5 and any("loss" in h for h in results["history"])
    report = _python("report.py", str(out))
    assert report.returncode == 0, report.stderr[-2000:]
    assert (out / "curves.png").stat().st_size > 1000 and "from_pretrained loads it" in report.stdout


def test_loop_recipe_smoke_run_on_two_processes_and_resume(tiny, tmp_path):
    out = tmp_path / "run"
    args = [*recipe_args(tiny, out), "--checkpointing_steps", "2"]
    proc = cli("launch", "--cpu", "--num_processes", "2", str(RECIPES / "run_glue_loop.py"), *args, timeout=300,
               **OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((out / "results.json").read_text())
    assert first["world_size"] == 2 and first["flavour"] == "hf_backend.Accelerator loop"
    assert set(first["metrics"]["dev"]) == {"accuracy", "f1"}
    # saved at steps 2, 4, 6, 8 (4 steps an epoch); total_limit=2 keeps the newest two
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]
    proc = _python("run_glue_loop.py", *args, "--epochs", "3", "--resume", nproc=2)  # 2 processes again
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((out / "results.json").read_text())
    steps = [h["step"] for h in resumed["history"] if "loss" in h]
    assert steps[0] > 8 and steps[-1] == 12  # continued after epoch 2 (4 steps an epoch), not from the start


# -- the data reader: one line naming the file and row ---------------------------------------------------------------
def test_bad_input_is_one_line_naming_the_file_and_row(tiny, tmp_path):
    task = glue_data.get_task("mrpc")
    bad = tmp_path / "MRPC"
    bad.mkdir()
    (bad / "dev.tsv").write_text(HEADER + mrpc_rows(3, 1))
    cases = {
        "fields": HEADER + mrpc_rows(3, 0) + "1\t5\t6\tonly one sentence\n",
        "label": HEADER + mrpc_rows(2, 0) + "2\t5\t6\ta b\tc d\n",
    }
    for kind, text in cases.items():
        (bad / "train.tsv").write_text(text)
        with pytest.raises(glue_data.DataError) as err:
            glue_data.load(task, str(bad))
        where = f"{bad / 'train.tsv'}: row {4 if kind == 'label' else 5}: "
        assert str(err.value) == where + ("4 tab-separated fields, expected 5; fix or remove the row" if kind ==
                                          "fields" else "label '2' is not one of 0, 1")
    with pytest.raises(glue_data.DataError, match=r"--task cola2: not a GLUE task; use one of cola, sst2"):
        glue_data.get_task("cola2")
    with pytest.raises(glue_data.DataError, match=r"--data_dir .*nowhere: no such directory"):
        glue_data.load(task, str(tmp_path / "nowhere"))
    (bad / "dev.tsv").unlink()
    (bad / "train.tsv").write_text(HEADER + mrpc_rows(3, 0))
    with pytest.raises(glue_data.DataError, match=r"dev.tsv: missing; a GLUE mrpc folder holds train.tsv, dev.tsv"):
        glue_data.load(task, str(bad))

    proc = _python("run_glue.py", "--task", "mrpc", "--data_dir", str(bad), "--model", str(tiny[0]))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {bad / 'dev.tsv'}: missing; a GLUE mrpc folder holds " \
                                                   "train.tsv, dev.tsv"


def test_real_tsv_quirks_are_read_as_glue_means_them(tiny):
    """MRPC's byte-order mark and unbalanced quotes: every row stays one example, quotes kept as text."""
    data = glue_data.load(glue_data.get_task("mrpc"), str(tiny[1]))
    assert len(data["train"]) == 64 and len(data["dev"]) == 21
    assert data["train"][0]["text_a"].startswith('"') and data["train"][0]["label"] == 0


def test_the_offline_default_corpus():
    data = glue_data.load(glue_data.get_task("tweets"), None, max_train=100, max_eval=50)
    assert (len(data["train"]), len(data["test"])) == (100, 50)
    assert set(data["train"]["label"]) <= {0, 1, 2} and data["train"][0]["text_b"] is None


# -- metrics -----------------------------------------------------------------------------------------------------------
def test_metric_module_computes_the_official_glue_metrics():
    predictions, references = [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]  # tp 3, tn 1, fp 1, fn 1
    mrpc = glue_data.metric(glue_data.get_task("mrpc")).compute(predictions=predictions, references=references)
    assert mrpc == pytest.approx({"accuracy": 4 / 6, "f1": 0.75})
    cola = glue_data.metric(glue_data.get_task("cola")).compute(predictions=predictions, references=references)
    assert cola["matthews_correlation"] == pytest.approx((3 * 1 - 1 * 1) / (4 * 4 * 2 * 2) ** 0.5)
    x, y = [1.0, 2.0, 2.0, 4.0], [0.5, 1.0, 3.0, 5.0]
    stsb = glue_data.metric(glue_data.get_task("stsb")).compute(predictions=x, references=y)
    assert stsb["pearson"] == pytest.approx(statistics.correlation(x, y))
    assert stsb["spearmanr"] == pytest.approx(statistics.correlation([1, 2.5, 2.5, 4], [1, 2, 3, 4]))  # ties: 2.5
    tweets = glue_data.metric(glue_data.get_task("tweets")).compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])
    assert tweets == pytest.approx({"accuracy": 0.75, "macro_f1": (1 + 2 / 3 + 2 / 3) / 3})
