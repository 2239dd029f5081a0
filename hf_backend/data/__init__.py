"""Data loading on the engine: the prepared loader (loader.py), its map-style and unsplit sources (sources.py) and
streams split across processes (streaming.py)."""

from .loader import Position, PreparedDataLoader, prepare_dataloader, skip_first_batches

__all__ = ["Position", "PreparedDataLoader", "prepare_dataloader", "skip_first_batches"]
