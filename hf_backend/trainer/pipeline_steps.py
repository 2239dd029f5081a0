"""hf_backend.Trainer on pipeline stages (`TrainingArguments(parallelism_config=ParallelismConfig(pp_size=P))`).

transformers' loop runs unchanged; where it calls the model, the stages run instead: the training step through the
schedule forward and backward (`accelerator.forward_backward`), the evaluation step forward only
(`accelerator.forward_only`), each with transformers' own item count, so that the logged and evaluated losses are one
process's. What cannot run through stages (a loss of the trainer's own, label smoothing) is refused when the trainer
is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import transformers

from ..core.errors import ConfigError
from ..core.notes import note
from ..strategies.capabilities import Pipelined

if TYPE_CHECKING:  # the mixin's methods run on hf_backend.Trainer, a transformers.Trainer
    from transformers import Trainer as _Mixed

    from ..accelerator.facade import Accelerator
    from .arguments import TrainingArguments
else:
    _Mixed = object


class PipelineSteps(_Mixed):
    """Mixed into hf_backend.Trainer ahead of transformers' Trainer: its steps, through the stages under pp."""

    accelerator: Accelerator
    args: TrainingArguments

    @property
    def pipeline(self) -> Pipelined | None:
        strategy = self.accelerator.strategy
        return strategy if isinstance(strategy, Pipelined) else None

    def check_pipeline_fits(self) -> None:
        """One line, when the trainer is built, for what pipeline stages cannot run."""
        if self.pipeline is None:
            return
        pp = self.accelerator.parallelism_config.pp_size
        what = f"pp_size={pp} with {type(self).__name__}"
        for method in ("compute_loss", "prediction_step"):
            if getattr(type(self), method) is not getattr(transformers.Trainer, method) and \
                    getattr(type(self), method) is not getattr(PipelineSteps, method, None):
                raise ConfigError(f"{what}: it overrides {method}, which calls the model; under pipeline "
                                  "parallelism the stages compute the causal-LM loss themselves (online RL's "
                                  "generate and losses of a trainer's own cannot run through them): train with "
                                  "hf_backend.Trainer, or without pp")
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            raise ConfigError(f"{what}: compute_loss_func and label_smoothing_factor replace the model's loss, which "
                              "pipeline stages compute themselves (a causal LM's cross-entropy); drop them, or "
                              "train without pp")
        if not self.args.average_tokens_across_devices:
            note("pp: the loss is the mean over the global batch's target tokens, as with "
                 "average_tokens_across_devices=True")

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if self.pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        train = getattr(self.optimizer, "train", None)  # schedule-free optimizers
        if callable(train):
            train()
        inputs = self._prepare_inputs(inputs)
        if inputs.get("labels") is None:
            raise ConfigError("training on pipeline stages needs labels in every batch (a data collator for "
                              "language modelling puts the input ids there)")
        count = self._items_of_the_global_batch(num_items_in_batch)
        loss = self.accelerator.forward_backward(model, inputs, num_items_in_batch=count)
        return loss if count is not None else loss / self.current_gradient_accumulation_steps

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        if self.pipeline is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels") if has_labels else None
        count = self._items_of_the_global_batch(self._get_num_items_in_batch([inputs], self.args.device)) \
            if has_labels else None
        batch = inputs if has_labels else {k: v for k, v in inputs.items() if k != "labels"}
        loss, logits = self.pipeline.forward_only(model, batch, count, logits=not prediction_loss_only)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels.detach() if labels is not None else None

    def get_total_train_batch_size(self, args: Any) -> int:
        """transformers divides the world by tp, cp and sp; the pp ranks read the same rows too."""
        pp = self.accelerator.parallelism_config.pp_size if self.pipeline is not None else 1
        return super().get_total_train_batch_size(args) // pp

    def _items_of_the_global_batch(self, counted: Any) -> torch.Tensor | None:
        """transformers' item count, made the target tokens of the global batch (of every accumulated micro
        step): it gathers its count over every process, which counts each row once per pp rank."""
        if counted is None:
            return None
        pp = self.accelerator.parallelism_config.pp_size
        counted = torch.as_tensor(counted, device=self.args.device).float()
        if not self.args.average_tokens_across_devices and self.args.world_size > 1:
            counted = self.accelerator.reduce(counted, "sum")
        return counted / pp
