"""Enumerations shared across lightning_accel, with the names and values of Accelerate 1.15.

Two flavours exist, as in Accelerate:

* ``(str, Enum)`` classes (:class:`DistributedType`, :class:`ComputeEnvironment`, ...) compare equal to their string
  value and serialise to JSON as plain strings; ``str()`` of a member keeps Python's default ``Class.MEMBER`` form.
* :class:`BaseEnum` subclasses print as their value, list their values with :meth:`BaseEnum.list`, and support
  ``value in EnumClass`` membership tests by value.
"""

from __future__ import annotations

import enum

__all__ = [
    "BaseEnum",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]


class EnumWithContains(enum.EnumMeta):
    """Enum metaclass whose ``in`` operator looks members up by value.

    ``"bf16" in PrecisionType`` is ``True`` because ``PrecisionType("bf16")`` succeeds; anything the enum constructor
    rejects is reported as not contained instead of raising.
    """

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except (ValueError, TypeError):
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """Enum base whose members print as their value and can be listed.

    Example:
        >>> str(PrecisionType.BF16)
        'bf16'
        >>> "fp16" in PrecisionType
        True

    """

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        """Return the string form of every member, in definition order."""
        return list(map(str, cls))


class DistributedType(str, enum.Enum):
    """Kind of distributed environment a run uses; each value equals its name.

    Attributes:
        NO: A single process, no distribution.
        MULTI_CPU: Data parallel across CPU processes.
        MULTI_GPU: Data parallel across CUDA (or ROCm) devices.
        MULTI_NPU: Data parallel across Ascend NPUs.
        MULTI_MLU: Data parallel across Cambricon MLUs.
        MULTI_SDAA: Data parallel across SDAA devices.
        MULTI_MUSA: Data parallel across Moore Threads MUSA devices.
        MULTI_XPU: Data parallel across Intel XPUs.
        DEEPSPEED: DeepSpeed engine.
        FSDP: Fully Sharded Data Parallel (FSDP1 or FSDP2).
        XLA: torch_xla (TPU and other XLA devices).
        MEGATRON_LM: Megatron-LM tensor / pipeline parallelism.
        MULTI_HPU: Data parallel across Intel Gaudi HPUs.
        MULTI_NEURON: Data parallel across AWS Neuron cores.

    """

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
    """Distribution mode of an Amazon SageMaker job.

    Attributes:
        NO: No SageMaker distribution.
        DATA_PARALLEL: SageMaker distributed data parallelism.
        MODEL_PARALLEL: SageMaker distributed model parallelism.

    """

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class FP8BackendType(str, enum.Enum):
    """Library that implements FP8 training.

    Attributes:
        NO: No FP8 backend.
        TE: NVIDIA Transformer Engine.
        MSAMP: Microsoft MS-AMP.
        AO: torchao float8.

    """

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class ComputeEnvironment(str, enum.Enum):
    """Where a job runs.

    Attributes:
        LOCAL_MACHINE: A local machine or a self-managed cluster.
        AMAZON_SAGEMAKER: Amazon SageMaker.

    """

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class DynamoBackend(str, BaseEnum):
    """``torch.compile`` backend; values are upper-case, ``torch.compile`` takes ``value.lower()``.

    Attributes:
        NO: Do not compile.
        EAGER: Run the captured graph eagerly (debugging).
        AOT_EAGER: AOTAutograd without a compiler (debugging).
        INDUCTOR: TorchInductor, the default compiler.
        AOT_TS_NVFUSER: nvFuser through AOTAutograd / TorchScript.
        NVPRIMS_NVFUSER: nvFuser through PrimTorch.
        CUDAGRAPHS: CUDA graphs through AOTAutograd.
        OFI: TorchScript ``optimize_for_inference`` (inference only).
        FX2TRT: TensorRT through FX (inference only).
        ONNXRT: ONNX Runtime (inference only).
        TENSORRT: ONNX Runtime's TensorRT provider.
        AOT_TORCHXLA_TRACE_ONCE: torch_xla dynamo bridge for training.
        TORCHXLA_TRACE_ONCE: torch_xla dynamo bridge for inference.
        TVM: Apache TVM.
        HPU_BACKEND: Intel Gaudi backend.
        NEURON: AWS Neuron backend.

    """

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
    """Experiment tracker name.

    Attributes:
        ALL: Every supported tracker that is installed.
        AIM: Aim.
        TENSORBOARD: TensorBoard.
        WANDB: Weights & Biases.
        TRACKIO: Trackio.
        COMETML: Comet ML.
        MLFLOW: MLflow.
        CLEARML: ClearML.
        DVCLIVE: DVCLive.
        SWANLAB: SwanLab.

    """

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


class PrecisionType(str, BaseEnum):
    """Mixed-precision mode.

    Attributes:
        NO: Full precision (fp32).
        FP8: FP8 matmuls through an FP8 backend, bf16 elsewhere.
        FP16: fp16 autocast with a gradient scaler.
        BF16: bf16 autocast.

    """

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(BaseEnum):
    """Random number generator whose state is synchronised across processes.

    Not a ``str`` subclass: ``RNGType.TORCH == "torch"`` is ``False``, but ``"torch" in RNGType`` is ``True``.

    Attributes:
        TORCH: The CPU torch generator.
        CUDA: The CUDA generator of the current device.
        MLU: The MLU generator.
        SDAA: The SDAA generator.
        MUSA: The MUSA generator.
        NPU: The NPU generator.
        XLA: The XLA generator.
        XPU: The XPU generator.
        HPU: The HPU generator.
        NEURON: The Neuron generator.
        GENERATOR: A user-supplied ``torch.Generator`` (for example a sampler's).

    """

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
    """Gradient communication hook (or hook wrapper) registered on a DDP model.

    Attributes:
        NO: No hook: DDP's default all-reduce.
        FP16: Compress gradients to fp16 for the all-reduce.
        BF16: Compress gradients to bf16 for the all-reduce.
        POWER_SGD: PowerSGD low-rank gradient compression.
        BATCHED_POWER_SGD: Batched PowerSGD.

    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class CustomDtype(enum.Enum):
    """Data types torch has no ``torch.dtype`` for, used when sizing quantised weights.

    Attributes:
        FP8: 8-bit floating point.
        INT4: 4-bit integer.
        INT2: 2-bit integer.

    """

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"
