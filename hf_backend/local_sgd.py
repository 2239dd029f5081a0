"""Accelerate's module path `accelerate.local_sgd`; LocalSGD lives in hf_backend.training.local_sgd."""

from .training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
