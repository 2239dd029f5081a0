"""Accelerate's module path `accelerate.logging`; the logger lives in hf_backend.runtime.log."""

from .runtime.log import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
