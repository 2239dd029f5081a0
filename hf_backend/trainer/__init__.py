"""transformers' Trainer and TrainingArguments on hf_backend's engine (needs `transformers`)."""

from .arguments import TrainingArguments
from .subclasses import on_engine
from .trainer import Trainer, last_complete_checkpoint

__all__ = ["Trainer", "TrainingArguments", "last_complete_checkpoint", "on_engine"]
