"""The causal-LM SFT recipe (recipes/causal_lm): packed batches compute exactly what each example alone computes, the
prompt stays out of the loss, and seconds-long runs of the recipe (one process packed, two processes padded with a
LoRA adapter) train, evaluate, answer held-out prompts and save a model that from_pretrained loads.

The runs fork from the suite's warm interpreter (tests/warm_processes.py), as the GLUE recipes' smoke runs do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_script

pytest.importorskip("datasets")
RECIPES = Path(__file__).parent.parent / "recipes" / "causal_lm"
import sft_data  # noqa: E402 - recipes/causal_lm, on the path through pyproject's pytest `pythonpath`

PAIRS = [  # responses of 1, 3 and 2 words; prompts of different lengths
    sft_data.Pair("Is the sentiment of this tweet positive, negative or neutral?\n@united thanks!\nAnswer:",
                  " positive"),
    sft_data.Pair("Say it again:\nthe cat sat on the mat\nAnswer:", " the cat sat"),
    sft_data.Pair("Is the sentiment of this tweet positive, negative or neutral?\nmy flight is late, again\nAnswer:",
                  " negative again"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return sft_data.load_tokenizer(None)


def _per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss at each position of one row (0 where the label is -100)."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")


def test_packed_row_computes_what_each_example_alone_computes(tokenizer):
    examples, dropped = sft_data.encode(tokenizer, PAIRS, max_length=64)
    assert dropped == 0 and len({len(e["input_ids"]) for e in examples}) == 3
    for pair, example in zip(PAIRS, examples):  # BOS and prompt masked; the response and EOS learned
        response = tokenizer(pair.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        prompt = len(example["input_ids"]) - len(response)
        assert example["input_ids"][0] == tokenizer.bos_token_id
        assert example["labels"] == [-100] * prompt + response and example["input_ids"][prompt:] == response

    torch.manual_seed(0)
    model = sft_data.tiny_llama(tokenizer, layers=2, hidden=64, max_length=64).eval()
    model.config.use_cache = False  # as the recipe and the Trainer set it (see the last check below)
    assert model.config._attn_implementation == "sdpa"  # the default on CPU
    packed = sft_data.collator(True, tokenizer.pad_token_id)(examples)
    assert set(packed) == {"input_ids", "labels", "position_ids"} and packed["input_ids"].shape[0] == 1
    assert packed["position_ids"][0].tolist() == [i for e in examples for i in range(len(e["input_ids"]))]
    with torch.no_grad():
        out = model(**packed)
        alone = [model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]]))
                 for e in examples]
    expected_logits, expected_losses = [], []
    for example, result in zip(examples, alone):
        expected_logits.append(result.logits[0])
        # the boundary: the previous example's last token is not asked to predict this one's first (label -100)
        expected_losses += [torch.zeros(1), _per_token_losses(result.logits[0], torch.tensor(example["labels"]))]
    expected_losses = torch.cat(expected_losses)[1:]
    torch.testing.assert_close(out.logits[0], torch.cat(expected_logits), atol=1e-5, rtol=0)
    torch.testing.assert_close(_per_token_losses(out.logits[0], packed["labels"][0]), expected_losses, atol=1e-5,
                               rtol=0)
    learned = sum(sum(label != -100 for label in e["labels"]) for e in examples)
    assert (packed["labels"] != -100).sum() == learned  # no prompt token, no boundary in the loss
    token_mean = sum(r.loss * sum(label != -100 for label in e["labels"]) for r, e in zip(alone, examples)) / learned
    assert abs(out.loss.item() - token_mean.item()) < 1e-5

    padded = sft_data.collator(False, tokenizer.pad_token_id)(examples)
    width = padded["input_ids"].shape[1]
    assert padded["attention_mask"].sum(1).tolist() == [len(e["input_ids"]) for e in examples]
    assert all((padded["labels"][i, len(e["input_ids"]):] == -100).all() for i, e in enumerate(examples))
    assert (padded["input_ids"][padded["attention_mask"] == 0] == tokenizer.pad_token_id).all() and width == max(
        len(e["input_ids"]) for e in examples)
    with torch.no_grad():
        assert abs(model(**padded).loss.item() - token_mean.item()) < 1e-5

        # The checks have power: without position_ids the row is one causal sequence, and with use_cache on (most
        # configs' default) transformers 5.23 builds a KV cache even for this forward and then ignores the restarts
        # in position_ids, so the second example attends to the first either way.
        second = slice(len(examples[0]["input_ids"]), len(examples[0]["input_ids"]) + len(examples[1]["input_ids"]))
        crossed = model(input_ids=packed["input_ids"]).logits[0, second]
        assert (crossed - expected_logits[1]).abs().max() > 1e-2
        model.config.use_cache = True
        cached = model(**packed).logits[0, second]
    assert (cached - expected_logits[1]).abs().max() > 1e-2, (
        "transformers now finds packed sequences with use_cache on: run_sft.py's `model.config.use_cache = False` "
        "and this check can go")


def test_data_file_and_its_one_line_errors(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f" a{i}"}) + "\n" for i in range(20)))
    splits = sft_data.load_pairs(str(good), None, None)
    assert [len(splits["train"]), len(splits["test"])] == [18, 2] and splits["test"][0] == sft_data.Pair("q18", " a18")
    bad = tmp_path / "bad.jsonl"
    for text, message in ((json.dumps({"prompt": "q"}) + "\n", "line 1: expected an object with string fields"),
                          ('{"prompt": "q", "response": "a"}\n{oops\n', "line 2: not JSON")):
        bad.write_text(text)
        with pytest.raises(sft_data.DataError, match=message):
            sft_data.load_pairs(str(bad), None, None)
    proc = run_script(RECIPES / "run_sft.py", ["--data_file", str(tmp_path / "none.jsonl")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: --data_file {tmp_path / 'none.jsonl'}: no such file; " \
                                                   'give a JSON-lines file with one {"prompt": ..., "response": ...} ' \
                                                   "object a line"


TINY = ["--num_layers", "1", "--hidden_size", "32", "--max_train_samples", "64", "--max_eval_samples", "16",
        "--batch_size", "4", "--lr", "1e-2", "--logging_steps", "2", "--num_samples", "4"]


def _check_run(out: Path, world_size: int, flavour: str, fall: float) -> dict:
    """results.json and samples.json are there, and the held-out and logged training losses fell by `fall` nats."""
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == world_size and results["flavour"] == flavour
    assert results["task"] == "tweet-sentiment" and results["train_samples_per_second"] > 0
    before, after = results["metrics"]["before training"], results["metrics"]["after training"]
    assert before["perplexity"] > 1000 and after["loss"] < before["loss"] - fall  # from about ln(30522) = 10.3
    losses = [h["loss"] for h in results["history"] if "loss" in h]
    assert len(losses) >= 4 and losses[-1] < losses[0] - fall
    assert any("eval_perplexity" in h for h in results["history"])
    samples = json.loads((out / "samples.json").read_text())
    assert len(samples) == 4 and {"prompt", "generated", "reference", "match"} <= set(samples[0])
    assert samples[0]["reference"] in sft_data.SENTIMENTS
    return results


def test_recipe_one_process_packed_and_report(tmp_path):
    out = tmp_path / "run"
    proc = run_script(RECIPES / "run_sft.py", [*TINY, "--eval_steps", "8", "--output_dir", str(out)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _check_run(out, 1, "hf_backend.Trainer, packed batches", fall=1.0)
    assert results["args"]["packing"] is True and "answers matching the reference" in proc.stdout
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    report = run_script(RECIPES / "report.py", [str(out)], check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "from_pretrained loads it: LlamaForCausalLM" in report.stdout and "loaded model answers" in report.stdout
    assert (out / "loss.png").stat().st_size > 1000


def test_recipe_two_processes_padded_with_lora(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    proc = run_script(RECIPES / "run_sft.py", [*TINY, "--no_packing", "--lora", "--lora_r", "4", "--lr", "3e-2",
                                               "--output_dir", str(out)], nproc=2, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # q_proj and v_proj adapters on a random 1-layer model, its embeddings frozen: the loss falls, but slowly
    _check_run(out, 2, "hf_backend.Trainer, padded batches, LoRA", fall=0.0)
    assert (out / "model" / "adapter_model.safetensors").is_file() and (out / "base_model" / "config.json").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")  # the base, found through the adapter's config
    assert any("lora_A" in name for name, _ in model.named_parameters())
