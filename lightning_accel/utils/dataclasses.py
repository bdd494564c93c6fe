"""Accelerate's ``accelerate.utils.dataclasses`` path: the configuration dataclasses and enums, re-exported.

The classes live in :mod:`lightning_accel.config` (dataclasses) and :mod:`lightning_accel.enums` (enums); this module
gives them Accelerate's import path, so ``from accelerate.utils.dataclasses import DistributedType`` has a
one-for-one replacement. It also holds Accelerate's literal types, ``TensorInformation``, ``get_module_class_from_name``
and ``TorchTensorParallelPlugin`` (Accelerate's older tensor-parallel plugin, deprecated there in favour of
``ParallelismConfig(tp_size=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_accel.config import (
    AutocastKwargs,
    BnbQuantizationConfig,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DeepSpeedSequenceParallelConfig,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    MegatronLMPlugin,
    ProjectConfiguration,
    TorchContextParallelConfig,
    TorchDynamoPlugin,
    TorchTensorParallelConfig,
)
from lightning_accel.config.fp8 import (
    AmaxComputeAlgorithm,
    AORecipeKwargs,
    Backend,
    FP8Format,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    OptLevel,
    TERecipeKwargs,
)
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.enums import (
    BaseEnum,
    ComputeEnvironment,
    CustomDtype,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    EnumWithContains,
    FP8BackendType,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from lightning_accel.utils.fsdp_utils import get_module_class_from_name
from lightning_accel.utils.operations import TensorInformation

__all__ = [
    "AORecipeKwargs",
    "AmaxComputeAlgorithm",
    "AutocastKwargs",
    "Backend",
    "BaseEnum",
    "BnbQuantizationConfig",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "FP8Format",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MSAMPRecipeKwargs",
    "MegatronLMPlugin",
    "OptLevel",
    "PrecisionType",
    "ProfileKwargs",
    "ProfilerActivity",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TensorInformation",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "get_module_class_from_name",
]

# The profiler activities ``ProfileKwargs(activities=...)`` names.
ProfilerActivity = Literal["cpu", "xpu", "mtia", "cuda", "hpu"]


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's tensor-parallel plugin (deprecated there in favour of ``ParallelismConfig(tp_size=...)``).

    Attributes:
        tp_size: The tensor-parallel degree, used to build the device mesh.
        torch_device_mesh: A ``torch.distributed.DeviceMesh`` to use instead of building one.

    """

    tp_size: int = field(
        default=1, metadata={"help": "tensor parallel size will be used in the device mesh preparation"}
    )
    torch_device_mesh: Any = field(default=None)
