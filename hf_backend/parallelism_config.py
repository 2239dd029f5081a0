"""Accelerate's module path for `ParallelismConfig` (`from accelerate.parallelism_config import
ParallelismConfig` ports by its import line); the class lives in hf_backend.config.parallelism."""

from .config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
