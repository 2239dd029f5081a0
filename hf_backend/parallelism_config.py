"""Accelerate's module path for `ParallelismConfig` (`from accelerate.parallelism_config import
ParallelismConfig` ports by its import line); the class lives in hf_backend.parallel.config."""

from .parallel.config import ParallelismConfig

__all__ = ["ParallelismConfig"]
