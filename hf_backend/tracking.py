"""Accelerate's module path `accelerate.tracking` (the tracker classes); they live in
hf_backend.accelerator.trackers, the Accelerator's tracking members in hf_backend.accelerator.tracking."""

from .accelerator.trackers import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
    on_main_process,
)
from .accelerator.tracking import get_available_trackers

__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "JSONLTracker",
           "MLflowTracker", "SwanLabTracker", "TensorBoardTracker", "TrackioTracker", "WandBTracker",
           "get_available_trackers", "on_main_process"]
