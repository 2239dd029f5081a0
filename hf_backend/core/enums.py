"""Accelerate's enums, with the same members and values, so scripts that compare against or import them
port as is.

Members name hardware and features hf_backend cannot run (XLA, NPU, fp8, Megatron, ...): they exist
so comparisons such as `accelerator.distributed_type == DistributedType.XLA` work (and are False
here); asking for one of those features is refused where it is asked for, with one line.
"""

from __future__ import annotations

import enum


class _ContainsValue(enum.EnumMeta):
    """`"fp16" in PrecisionType` is True: membership by value, as Accelerate's enums answer it."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=_ContainsValue):
    """`str(member)` is its value; `list()` gives every value."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class DistributedType(str, enum.Enum):
    """How the work is spread over processes. hf_backend runs NO, MULTI_CPU, MULTI_GPU, FSDP and
    DEEPSPEED."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class SageMakerDistributedType(str, enum.Enum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class ComputeEnvironment(str, enum.Enum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class FP8BackendType(str, enum.Enum):
    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class DynamoBackend(str, BaseEnum):
    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(BaseEnum):
    """Experiment trackers `Accelerator(log_with=...)` takes (hf_backend.tracking); `JSONL` is
    hf_backend's own."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"


class PrecisionType(str, BaseEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(BaseEnum):
    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DDPCommunicationHookType(BaseEnum):
    """DDP gradient communication hooks (torch's own): compression to fp16 / bf16, PowerSGD."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class CustomDtype(enum.Enum):
    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"
