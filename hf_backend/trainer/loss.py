"""hf_backend.Trainer's members about the loss: whether the model's loss honours
`num_items_in_batch` (asked of the model once), the causal-LM loss by chunks while training, the logged
loss's NaN/inf filter on the device, the flop estimate with the parameters counted once, and the
sequences split over the cp or sp ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.utils import is_torch_xla_available

from ..core.notes import note
from ..training import chunked_loss
from . import transformers_compat as compat

if TYPE_CHECKING:  # the mixin's methods run on hf_backend.Trainer, a transformers.Trainer
    from transformers import Trainer as _Mixed

    from ..accelerator.facade import Accelerator
    from .arguments import TrainingArguments
else:
    _Mixed = object


class LossMembers(_Mixed):
    """Mixed into hf_backend.Trainer, ahead of transformers' Trainer; hf_backend.Trainer's
    constructor sets what is declared here."""

    accelerator: Accelerator
    args: TrainingArguments
    model: torch.nn.Module  # transformers.Trainer's constructor refuses to go on without one
    _loss_checked: bool
    _counted_model: Any
    _counted_parameters: int

    # -- sequences split over the cp or sp ranks ---------------------------------------------------
    def get_cp_size(self) -> int:
        """How many slices each sequence is cut into, by cp or by hf_backend's sp: transformers
        divides the item count and the data-parallel world by it."""
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is None:
            return 1
        return config.cp_size * (1 if _deepspeed_ulysses(config) else config.sp_size)

    def get_sp_size(self) -> int:
        """DeepSpeed's sp size under its ALST (transformers multiplies the loader's length by it, for
        DeepSpeed's adapter, and takes its own loss path); else 1: hf_backend's sp is counted in
        `get_cp_size`."""
        config = getattr(self.accelerator, "parallelism_config", None)
        return config.sp_size if config is not None and _deepspeed_ulysses(config) else 1

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """The batch's sequence buffers (the input ids, labels, shifted labels made here, a 2-D
        padding mask, the position ids made here when absent) cut into this rank's slice inside
        `maybe_context_parallel`, for cp and sp alike; the engine checks them
        (hf_backend/strategies/sequences.py). transformers' own does this for cp only and refuses
        padding masks."""
        if self.get_cp_size() == 1:
            return contextlib.nullcontext, inputs
        if "labels" in inputs and "shift_labels" not in inputs:
            labels = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)
            inputs["shift_labels"] = labels[:, 1:].contiguous()
        if inputs.get("position_ids") is None and "input_ids" in inputs:
            ids = inputs["input_ids"]
            inputs["position_ids"] = torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1)
        names = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
        buffers = [inputs[name] for name in names if isinstance(inputs.get(name), torch.Tensor)
                   and (name != "attention_mask" or inputs[name].dim() == 2)]
        return functools.partial(self.accelerator.maybe_context_parallel, buffers=buffers,
                                 buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)), inputs

    # -- the causal-LM loss by chunks (training/chunked_loss.py) ------------------------------------
    def _chunked_loss(self) -> contextlib.AbstractContextManager:
        """For `train()`: a causal LM's loss computed without its whole logits, where it is the model's
        own loss exactly and nothing reads the training logits: `chunked_loss` (the default), transformers'
        compute_loss (a trainer's own, TRL's among them, may read the logits), no pipeline stages (whose
        last stage computes the loss itself), no tensor parallelism (the head's vocabulary is sharded:
        its chunks are not built yet). Label smoothing and compute_loss_func take the labels from the
        batch, so the model's own forward runs for them."""
        config = getattr(self.accelerator, "parallelism_config", None)
        if (not self.args.chunked_loss or getattr(self, "pipeline", None) is not None
                or (config is not None and config.tp_size > 1)
                or type(self).compute_loss is not transformers.Trainer.compute_loss
                or chunked_loss.unsupported(self.model) is not None):
            return contextlib.nullcontext()
        return chunked_loss.ChunkedLoss(self.model).installed()

    # -- the logged loss ---------------------------------------------------------------------------
    def _loss_to_log(self, loss: torch.Tensor) -> torch.Tensor:
        """What transformers' loop adds to the logged loss sum for a step's loss: the loss itself,
        or, with `logging_nan_inf_filter` and a NaN or infinite loss, the sum so far divided by the
        steps since the last log plus one. transformers decides with `torch.isnan(loss) or
        torch.isinf(loss)` on the host, which waits for the device after every backward; here
        `torch.where` picks on the device: the same numbers, no wait."""
        if self._tr_loss.device != loss.device:  # transformers' check (it skips it for a NaN loss)
            raise ValueError("Calculated loss must be on the original device: "
                             f"{self._tr_loss.device} but device in use is {loss.device}")
        if not self.args.logging_nan_inf_filter or is_torch_xla_available():
            return loss
        since = 1 + self.state.global_step - self._globalstep_last_logged
        return torch.where(torch.isfinite(loss), loss, self._tr_loss / since)

    # -- loss normalization ------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """transformers passes models whose forward takes **kwargs the item count of the whole
        accumulated global batch and multiplies their loss by the number of processes, assuming the
        loss is a sum divided by that count. Many heads (BERT-family sequence classification among
        them) ignore the count and return a mean: transformers then reports, and backpropagates, the
        loss times the world size (and, with gradient accumulation, times the accumulation steps).
        So the first time it matters, ask the model once: without that behaviour it is treated as
        taking no loss kwargs, and its mean loss is averaged as for any other."""
        if self._loss_check_needed(batch_samples):
            self._loss_checked = True
            self.model_accepts_loss_kwargs = self._loss_divides_by_item_count(batch_samples[0])
            if not self.model_accepts_loss_kwargs:
                note("the model's loss ignores num_items_in_batch (a mean per batch): averaged "
                     "over processes and accumulation steps as such")
        return super()._get_num_items_in_batch(batch_samples, device)

    def _loss_check_needed(self, batch_samples: list) -> bool:
        """Called every step: settled for the run at the first call where nothing can make the check
        matter."""
        if self._loss_checked or not self.model_accepts_loss_kwargs:
            return False
        spread = self.args.world_size > 1 or self.args.gradient_accumulation_steps > 1
        declared = hasattr(self.accelerator.unwrap_model(self.model), "accepts_loss_kwargs")
        if not spread or declared or self.compute_loss_func is not None or \
                compat.loss_is_scaled_for_ga(self) is not None:
            self._loss_checked = True
            return False
        return len(batch_samples) > 0 and isinstance(batch_samples[0], Mapping) and "labels" in batch_samples[0]

    @torch.no_grad()
    def _loss_divides_by_item_count(self, batch: Mapping[str, Any]) -> bool:
        """Evaluate the loss of one batch with the item count and with twice the count: a loss that
        divides by it halves. Dropout is off, the random state is kept and the strategy is told
        (`outside_training`), so training continues exactly as without the check. Under context
        parallelism the model runs on its slices, as in training (on copies: the batch is trained on
        next)."""
        model = self.model_wrapped
        inputs = self._prepare_inputs(batch)  # type: ignore[arg-type]  # transformers says dict; any Mapping works
        count = inputs["labels"].ne(-100).sum()

        def loss(count: torch.Tensor) -> torch.Tensor:
            copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            # cp: splits the copy in place
            context, copy = self._prepare_context_parallel_inputs(model, copy)
            with context():
                return _loss_of(model(**copy, num_items_in_batch=count))

        # each module's own mode back afterwards: in evaluation (prediction_step asks too) the model inside is in
        # eval mode while its DDP wrapper may still say training, and train(wrapper.training) would flip it back
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            with torch.random.fork_rng(devices=[]), self.accelerator.strategy.outside_training():
                one, two = loss(count), loss(count * 2)
        finally:
            for module, training in modes:
                module.training = training
        divides = bool(torch.isclose(one, 2 * two, rtol=1e-3)) and not bool(torch.isclose(one, two, rtol=1e-3))
        return bool(self.accelerator.gather(torch.tensor([divides], device=self.args.device)).all())

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate (6 x input tokens x non-embedding parameters), with the parameters
        counted once per model instead of at every step (a walk over every module and parameter: 80
        us a step for a 2-layer BERT)."""
        model = self.model
        main_input = getattr(model, "main_input_name", "input_ids")
        num_parameters = getattr(model, "num_parameters", None)
        if main_input not in inputs or num_parameters is None:
            return 0
        if self._counted_model is not model:
            self._counted_model, self._counted_parameters = model, num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self._counted_parameters


def _loss_of(outputs: Any) -> torch.Tensor:
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]


def _deepspeed_ulysses(config: Any) -> bool:
    """Whether DeepSpeed's ALST splits the sequences (the engine reports sp_backend "deepspeed" only then)."""
    return config.sp_size > 1 and config.sp_backend == "deepspeed"
