"""Accelerate's ``accelerate.utils.dataclasses`` path: the configuration dataclasses and enums, re-exported.

The classes live in :mod:`lightning_accel.config` (dataclasses) and :mod:`lightning_accel.enums` (enums); this module
only gives them Accelerate's import path, so ``from accelerate.utils.dataclasses import DistributedType`` has a
one-for-one replacement.
"""

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
from lightning_accel.config.fp8 import AORecipeKwargs, FP8RecipeKwargs, TERecipeKwargs
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

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
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
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MegatronLMPlugin",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
]
