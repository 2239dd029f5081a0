"""Accelerate's `is_*_available()` helpers, which scripts use as guards: what this machine has
installed and can run.

Hardware hf_backend does not drive (XLA/TPU, NPU, MLU, MUSA, SDAA, HPU, Neuron, XPU) answers False,
so a guarded branch for it is skipped; packages answer whether they can be imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable

import torch
from packaging.version import Version

from .errors import HfBackendError


@functools.cache
def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


def _package(*names: str) -> Callable[..., bool]:
    def available(*args: object, **kwargs: object) -> bool:
        return _installed(*names)

    return available


PACKAGES = {
    "aim": ("aim",), "boto3": ("boto3",), "clearml": ("clearml",), "comet_ml": ("comet_ml",),
    "datasets": ("datasets",), "deepspeed": ("deepspeed",), "dvclive": ("dvclive",), "matplotlib": ("matplotlib",),
    "mlflow": ("mlflow",), "pandas": ("pandas",), "peft": ("peft",), "pynvml": ("pynvml",), "pytest": ("pytest",),
    "rich": ("rich",), "sagemaker": ("sagemaker",), "schedulefree": ("schedulefree",), "swanlab": ("swanlab",),
    "tensorboard": ("tensorboard",), "timm": ("timm",), "torchao": ("torchao",), "torchdata": ("torchdata",),
    "torchvision": ("torchvision",), "trackio": ("trackio",), "transformers": ("transformers",),
    "triton": ("triton",), "wandb": ("wandb",), "import_timer": ("import_timer",), "amdsmi": ("amdsmi",),
    "lomo": ("lomo_optim",), "bnb": ("bitsandbytes",), "msamp": ("msamp",),
    "transformer_engine": ("transformer_engine",), "megatron_lm": ("megatron",), "pippy": ("pippy",),
    "torchdata_stateful_dataloader": ("torchdata",),
}
for _name, _modules in PACKAGES.items():
    globals()[f"is_{_name}_available"] = _package(*_modules)
is_rich_available = _package("rich")  # named here too: the package's __init__ imports it (for the checker)

# Devices and features hf_backend does not run: False, so scripts take their portable branch.
NOT_HERE = ("torch_xla", "npu", "mlu", "musa", "sdaa", "hpu", "neuron", "xpu", "xccl", "fp8", "4bit_bnb",
            "8bit_bnb", "bitsandbytes_multi_backend", "transformer_engine_mxfp8")


def _false(*args: object, **kwargs: object) -> bool:
    return False


for _name in NOT_HERE:
    globals()[f"is_{_name}_available"] = _false
is_habana_gaudi1 = _false


def is_rocm_available() -> bool:
    return torch.version.hip is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    return torch.backends.mps.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 autocast runs on the CPU, and on a CUDA device that supports it."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    """fp16 mixed precision (with a gradient scaler) needs a CUDA device here."""
    return torch.cuda.is_available()


def is_weights_only_available() -> bool:
    return True  # torch.load(weights_only=True) exists in every torch hf_backend supports


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """`compare_versions("torch", ">=", "2.4")`: the installed (or given) version against a
    requirement."""
    ops = {">": Version.__gt__, ">=": Version.__ge__, "==": Version.__eq__, "!=": Version.__ne__,
           "<=": Version.__le__, "<": Version.__lt__}
    if operation not in ops:
        raise HfBackendError(f"compare_versions: operation {operation!r} "
                             f"is not one of {', '.join(ops)}")
    if isinstance(library_or_version, str) and not library_or_version[:1].isdigit():
        library_or_version = importlib.metadata.version(library_or_version)
    return ops[operation](Version(str(library_or_version)), Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    return compare_versions(torch.__version__.split("+")[0], operation, version)
