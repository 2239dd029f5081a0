"""Accelerate's module path `accelerate.launchers`; the launchers live in hf_backend.launch.notebook."""

from .launch.notebook import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
