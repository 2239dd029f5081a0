"""The causal-LM loss by chunks (hf_backend/training/chunked_loss.py; issue 57's first part), against the model's
own loss on the whole logits: the loss and every gradient within 1e-6 (fp32) on padded and packed batches, with and
without `num_items_in_batch`, with given `shift_labels`, on a tiny Llama (tied and untied) and a tiny Qwen3-MoE (its
router loss added as the model adds it); the calls it leaves to the model; the models it does not take; and
hf_backend.Trainer, which uses it by default, against `chunked_loss=False`."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_backend.training.chunked_loss import ChunkedLoss, linear_cross_entropy, unsupported  # noqa: E402

VOCAB, EXACT = 300, 1e-6


def llama(tied: bool = False, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, **config))


def qwen3_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        output_router_logits=True, tie_word_embeddings=False))


def padded() -> dict[str, torch.Tensor]:
    """3 rows of 20 tokens: a prompt masked, one row's second half masked, one row padded on the left."""
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 10:] = -100
    mask = torch.ones_like(ids)
    mask[2, :5] = 0
    labels[2, :6] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed() -> dict[str, torch.Tensor]:
    """One row of three packed sequences (positions restart), their boundaries not targets: `shift_labels` given
    (with `labels`, as transformers' Trainer passes them under cp)."""
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in (7, 9, 8)])[None]
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    shift[0, [6, 15, 23]] = -100  # the last token of each sequence predicts nothing
    return {"input_ids": ids, "position_ids": positions, "labels": ids, "shift_labels": shift}


def _loss_and_grads(model: torch.nn.Module, batch: dict, **kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    outputs = model(**batch, **kwargs)
    outputs.loss.backward()
    return outputs, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize("make", [llama, lambda: llama(tied=True), qwen3_moe], ids=["llama", "tied", "qwen3_moe"])
@pytest.mark.parametrize("batch", [padded, packed])
@pytest.mark.parametrize("items", [None, 29])
def test_the_loss_and_every_gradient_are_the_whole_logits(make, batch, items) -> None:
    own = make()
    chunked = copy.deepcopy(own)
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    expected, expected_grads = _loss_and_grads(own, batch(), **kwargs)
    with ChunkedLoss(chunked, chunk=7).installed():  # 7 tokens a chunk: the rows' ends fall inside chunks
        got, grads = _loss_and_grads(chunked, batch(), **kwargs)
    assert abs(float(got.loss) - float(expected.loss)) <= EXACT
    assert _largest(grads, expected_grads) <= EXACT
    assert got.logits is None and "logits" not in got
    if hasattr(expected, "aux_loss"):  # the router loss is in the loss, as the model adds it
        assert float(got.aux_loss) == pytest.approx(float(expected.aux_loss), abs=EXACT) and float(got.aux_loss) > 0


def test_a_chunk_with_no_targets_and_the_mean_over_none() -> None:
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0] = -100
    full = torch.nn.functional.cross_entropy((hidden @ weight.t())[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    loss = linear_cross_entropy(hidden, weight, labels, chunk=3)
    torch.testing.assert_close(loss, full, atol=EXACT, rtol=0)
    nothing = linear_cross_entropy(hidden, weight, torch.full((2, 5), -100))
    assert torch.isnan(nothing)  # as cross_entropy's mean over no targets
    with pytest.raises(ValueError, match="needs labels or shift_labels"):
        linear_cross_entropy(hidden, weight)


def test_under_autocast_the_products_are_the_heads() -> None:
    """bf16 autocast: the chunks' products in bf16 as the head's would be, the loss in fp32 from them."""
    own = llama()
    chunked = copy.deepcopy(own)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = _loss_and_grads(own, padded())
        with ChunkedLoss(chunked, chunk=7).installed():
            got, grads = _loss_and_grads(chunked, padded())
    assert got.loss.dtype == torch.float32
    assert abs(float(got.loss) - float(expected.loss)) <= 1e-3
    assert _largest(grads, expected_grads) <= 2e-2


def test_what_is_not_a_training_call_with_labels_is_the_models_own() -> None:
    model = llama()
    batch = padded()
    with ChunkedLoss(model).installed():
        assert model(input_ids=batch["input_ids"], logits_to_keep=1).logits.shape == (3, 1, VOCAB)
        assert model(input_ids=batch["input_ids"]).logits.shape == (3, 20, VOCAB)  # no labels
        model.eval()
        evaluated = model(**batch)
        assert evaluated.logits.shape == (3, 20, VOCAB) and evaluated.loss is not None
        model.train()
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)  # left as it was
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_models_whose_loss_it_would_not_be_are_named() -> None:
    assert unsupported(llama()) is None
    assert "final_logit_softcapping=30.0" in unsupported(llama(final_logit_softcapping=30.0))
    biased = llama()
    biased.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert "not a linear layer without bias" in unsupported(biased)
    custom = llama()
    custom.loss_function = lambda *args, **kwargs: torch.zeros(())
    assert "not transformers' ForCausalLMLoss" in unsupported(custom)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    assert unsupported(bert) is not None


def test_a_peft_models_base_takes_it() -> None:
    peft = pytest.importorskip("peft")
    own = peft.get_peft_model(llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    chunked = copy.deepcopy(own)
    expected, expected_grads = _loss_and_grads(own, padded())
    with ChunkedLoss(chunked, chunk=5).installed():
        got, grads = _loss_and_grads(chunked, padded())
    assert got.logits is None and abs(float(got.loss) - float(expected.loss)) <= EXACT
    assert len(grads) == 8 and all("lora_" in name for name in grads)  # A and B of q and v, 2 layers
    assert _largest(grads, expected_grads) <= EXACT


def _train(tmp_path, chunked: bool, **overrides) -> tuple[list[float], torch.Tensor, list[bool]]:
    from datasets import Dataset

    import hf_backend

    model = llama()
    rows = [{"input_ids": list(range(i, i + 6 + i % 5)), "labels": list(range(i, i + 6 + i % 5))} for i in range(8)]

    def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, row in enumerate(batch):
            n = len(row["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), torch.tensor(row["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    seen: list[bool] = []

    class Watch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append("forward" in vars(model.lm_head))

    args = hf_backend.TrainingArguments(output_dir=str(tmp_path / str(chunked)), per_device_train_batch_size=2,
                                        gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3,
                                        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                        chunked_loss=chunked, **overrides)
    trainer = hf_backend.Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                 data_collator=collate, callbacks=[Watch()])
    trainer.train()
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()]), seen


def test_the_trainer_trains_with_it_by_default_as_on_the_whole_logits(tmp_path) -> None:
    """Two AdamW steps (lr 1e-3) of two padded micro batches: the logged losses and the parameters within 1e-6 of
    `chunked_loss=False` (AdamW's first step divides each gradient element by its own size, so the gradients'
    rounding-level differences, 1e-7 above, move the parameters by up to 2e-4 x lr); the head is the model's own
    again after `train()`."""
    losses, params, seen = _train(tmp_path, chunked=True)
    full_losses, full_params, full_seen = _train(tmp_path, chunked=False)
    assert seen == [True, True] and full_seen == [False, False]
    assert len(losses) == 2 and max(abs(a - b) for a, b in zip(losses, full_losses)) <= EXACT
    assert float((params - full_params).abs().max()) <= EXACT


def test_a_trainer_with_a_loss_of_its_own_keeps_the_models() -> None:
    """A compute_loss of a subclass's (TRL's trainers have theirs, and read the logits) is left the model's."""
    import hf_backend

    class Own(hf_backend.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = hf_backend.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert isinstance(Own(model=llama(), args=args)._chunked_loss(), contextlib.nullcontext)
    assert not isinstance(hf_backend.Trainer(model=llama(), args=args)._chunked_loss(), contextlib.nullcontext)


# -- under each strategy: tests/scripts/llm_trainer.py in 2 processes, by chunks and on the whole logits -----------
STRATEGIES = ["ddp", "fsdp", "zero3"]


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory) -> dict:
    from helpers import run_report

    root, runs = tmp_path_factory.mktemp("chunked"), {}
    for strategy in STRATEGIES:
        if strategy == "zero3":
            pytest.importorskip("deepspeed")
        for full in (False, True):
            name = f"{strategy}-{'full' if full else 'chunked'}"
            runs[name] = run_report("llm_trainer.py", root / f"{name}.json", [
                "--output-dir", str(root / name), "--strategy", strategy, "--steps", "3", "--save-steps", "10",
                "--grad-accum", "2", *(["--full-logits"] if full else [])], nproc=2, timeout=300)
    return runs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_by_chunks_as_on_the_whole_logits(strategy_runs, strategy) -> None:
    """hf_backend.Trainer (3 AdamW steps of 2 padded micro batches a process, clipping at 0.5) by chunks and with
    `chunked_loss=False`: the logged losses and gradient norms within 1e-6, the parameters within 1e-5 (AdamW, lr
    1e-2: see the one-process test); the head computed the loss at every step of the chunked run only."""
    chunked, full = strategy_runs[f"{strategy}-chunked"], strategy_runs[f"{strategy}-full"]
    assert chunked["chunked"] == [True] * 3 and full["chunked"] == [False] * 3
    for key in ("losses", "grad_norms"):
        assert max(abs(a - b) for a, b in zip(chunked[key], full[key], strict=True)) <= EXACT, key
    assert max(abs(a - b) for a, b in zip(chunked["params"], full["params"], strict=True)) <= 1e-5


def test_an_accelerate_loop_takes_it_in_one_line() -> None:
    """`with hf_backend.chunked_loss(model):` around a loop on a prepared model: the losses and parameters of the
    loop without it, within 1e-6 (SGD); a model whose loss it would not be is refused in one line."""
    import hf_backend
    from hf_backend.core.errors import HfBackendError

    def loop(chunked: bool) -> tuple[list[float], torch.Tensor]:
        accelerator = hf_backend.Accelerator(cpu=True)
        model = llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        with hf_backend.chunked_loss(model) if chunked else contextlib.nullcontext():
            for _ in range(2):
                outputs = model(**padded())
                assert (outputs.logits is None) is chunked
                accelerator.backward(outputs.loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(outputs.loss))
        accelerator.end_training()
        return losses, torch.cat([p.detach().flatten() for p in model.parameters()])

    (losses, params), (full_losses, full_params) = loop(True), loop(False)
    assert max(abs(a - b) for a, b in zip(losses, full_losses)) <= EXACT
    assert float((params - full_params).abs().max()) <= EXACT
    with pytest.raises(HfBackendError, match=r"^chunked_loss: LlamaForCausalLM transforms its logits"):
        hf_backend.chunked_loss(llama(final_logit_softcapping=30.0))


def test_a_compiled_model_takes_it() -> None:
    """torch.compile of the whole model (AOT autograd, which traces the backward as inductor does, without
    generating code): the hooks and the chunks' autograd function are captured; the loss and every gradient are
    the eager model's on the whole logits, within 1e-6. (Regional compilation compiles the blocks only: the head and
    its loss stay eager.)"""
    own = llama()
    chunked = copy.deepcopy(own)
    expected, expected_grads = _loss_and_grads(own, padded())
    with ChunkedLoss(chunked, chunk=7).installed():
        got, _ = _loss_and_grads(torch.compile(chunked, backend="aot_eager"), padded())
    grads = {name: p.grad for name, p in chunked.named_parameters()}
    assert got.logits is None and abs(float(got.loss) - float(expected.loss)) <= EXACT
    assert _largest(grads, expected_grads) <= EXACT
