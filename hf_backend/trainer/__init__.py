"""transformers' Trainer and TrainingArguments on hf_backend's engine (needs `transformers`)."""

from .arguments import TrainingArguments
from .trainer import Trainer, last_complete_checkpoint

__all__ = ["Trainer", "TrainingArguments", "last_complete_checkpoint"]
