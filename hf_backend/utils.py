"""What Accelerate scripts import from `accelerate.utils`, under the same names.

A name hf_backend has is imported from its home module. A name that Accelerate has and hf_backend
refuses (big-model inference, Megatron-LM, fp8, TPU, Accelerate's internals: `hf_backend.refused`)
fails at import with one line saying why and what to use instead; docs/compat.md lists every name.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from .accelerator.states import PartialState
from .config.options import AutocastKwargs as AutocastKwargs
from .config.options import DataLoaderConfiguration as DataLoaderConfiguration
from .config.options import DistributedDataParallelKwargs as DistributedDataParallelKwargs
from .config.options import GradientAccumulationPlugin as GradientAccumulationPlugin
from .config.options import GradScalerKwargs as GradScalerKwargs
from .config.options import InitProcessGroupKwargs as InitProcessGroupKwargs
from .config.options import KwargsHandler as KwargsHandler
from .config.options import ProfileKwargs as ProfileKwargs
from .config.options import ProjectConfiguration as ProjectConfiguration
from .config.options import TorchDynamoPlugin as TorchDynamoPlugin
from .config.plugins import DeepSpeedPlugin as DeepSpeedPlugin
from .config.plugins import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
from .core import availability, refused
from .core.availability import compare_versions as compare_versions
from .core.availability import is_torch_version as is_torch_version
from .core.enums import ComputeEnvironment as ComputeEnvironment
from .core.enums import CustomDtype as CustomDtype
from .core.enums import DDPCommunicationHookType as DDPCommunicationHookType
from .core.enums import DistributedType as DistributedType
from .core.enums import DynamoBackend as DynamoBackend
from .core.enums import FP8BackendType as FP8BackendType
from .core.enums import LoggerType as LoggerType
from .core.enums import PrecisionType as PrecisionType
from .core.enums import RNGType as RNGType
from .core.enums import SageMakerDistributedType as SageMakerDistributedType
from .core.environ import patched
from .core.errors import HfBackendError
from .core.nested import recursively_apply as recursively_apply
from .core.nested import send_to_device as send_to_device
from .parallel.config import DeepSpeedSequenceParallelConfig as DeepSpeedSequenceParallelConfig
from .parallel.config import ParallelismConfig as ParallelismConfig
from .parallel.config import TorchContextParallelConfig as TorchContextParallelConfig
from .parallel.config import TorchTensorParallelConfig as TorchTensorParallelConfig
from .runtime.collectives import broadcast as broadcast
from .runtime.collectives import broadcast_object_list as broadcast_object_list
from .runtime.collectives import gather as gather
from .runtime.collectives import gather_object as gather_object
from .runtime.collectives import pad_across_processes as pad_across_processes
from .runtime.collectives import reduce as _reduce
from .runtime.seeding import set_seed as set_seed
from .runtime.seeding import synchronize_rng_state as synchronize_rng_state
from .runtime.seeding import synchronize_rng_states as synchronize_rng_states
from .strategies.compile import compile_regions as compile_regions
from .strategies.compile import has_compiled_regions as has_compiled_regions
from .training.memory import find_executable_batch_size as find_executable_batch_size
from .training.memory import release_memory as release_memory
from .training.optim import DummyOptim as DummyOptim
from .training.optim import DummyScheduler as DummyScheduler
from .training.unwrap import extract_model_from_parallel as extract_model_from_parallel
from .training.unwrap import is_compiled_module as is_compiled_module

# Accelerate's in-place variants for its FSDP2 and DeepSpeed paths: here every region is compiled in place
compile_regions_fsdp2 = compile_regions_deepspeed = compile_regions


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """`accelerate.utils.reduce`: "mean" by default (the Accelerator's method defaults to "sum")."""
    return _reduce(tensor, reduction, scale)


def wait_for_everyone() -> None:
    PartialState().wait_for_everyone()


def save(obj: Any, f: str | os.PathLike, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save `obj` from the main process (the local main process of each node with `save_on_each_node`).
    """
    state = PartialState()
    if state.is_local_main_process if save_on_each_node else state.is_main_process:
        from .checkpoint import save_object

        save_object(obj, f, safe_serialization)


def load(f: str | os.PathLike, map_location: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """tqdm's progress bar, shown by the local main process only (unless `main_process_only=False`).
    """
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and not kwargs.get("disable", False):
        kwargs["disable"] = PartialState().local_process_index != 0
    return _tqdm(*args, **kwargs)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in a (nested) batch."""
    for value in _leaves(data):
        if isinstance(value, torch.Tensor):
            return value.shape[0]
    raise HfBackendError(f"find_batch_size: no tensor in the batch ({type(data).__name__})")


def _leaves(data: Any) -> Iterator[Any]:
    from .core.nested import leaves

    return leaves(data)


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def listify(data: Any) -> Any:
    """Tensors in `data` as (nested) Python lists."""
    return recursively_apply(lambda t: t.tolist(), data)


def concatenate(data: list, dim: int = 0) -> Any:
    """Concatenate a list of (nested) batches of the same structure along `dim`."""
    first = data[0]
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate([d[i] for d in data], dim=dim) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if not isinstance(first, torch.Tensor):
        raise HfBackendError("concatenate: can only concatenate tensors, got "
                             f"{type(first).__name__}")
    return torch.cat(data, dim=dim)


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Accelerate's truth values: y/yes/t/true/on/1 -> 1, n/no/f/false/off/0 -> 0."""
    value = value.lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise HfBackendError(f"str_to_bool: {value!r} is not a truth value; "
                         "use yes/no, true/false, on/off or 1/0")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return bool(str_to_bool(os.environ.get(key, str(default)), to_bool=True))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of `env_keys` set to a non-negative integer, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on localhost:`port` (29500 when not given, torch's default master
    port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port or 29500)) == 0


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (names upper-cased) inside the block; restore the previous values
    after."""
    with patched({key.upper(): str(value) for key, value in kwargs.items()}):
        yield


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty environment; restore it after."""
    with patched(dict.fromkeys(os.environ), restore_all=True):
        yield


def __getattr__(name: str) -> Any:
    if name in refused.REFUSED_NAMES:
        raise refused.refuse("hf_backend.utils", name)
    if name.startswith("is_") and hasattr(availability, name):
        return getattr(availability, name)
    raise AttributeError(f"module 'hf_backend.utils' has no attribute {name!r}")


__all__ = sorted(  # what `from hf_backend.utils import *` gives: every hf_backend object named here
    name for name, value in globals().items()
    if not name.startswith("_") and not isinstance(value, ModuleType)
    and getattr(value, "__module__", "").startswith("hf_backend"))
