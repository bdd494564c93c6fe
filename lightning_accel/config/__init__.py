"""Configuration dataclasses with Accelerate 1.15's names, fields and defaults.

They are plain data: they validate their fields in ``__post_init__`` and never read environment variables.
"""

from lightning_accel.config.deepspeed import DeepSpeedPlugin
from lightning_accel.config.dynamo import TorchDynamoPlugin
from lightning_accel.config.file import AccelerateConfig, load_config, write_machine_config
from lightning_accel.config.fsdp import FullyShardedDataParallelPlugin
from lightning_accel.config.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from lightning_accel.config.megatron import MegatronLMPlugin
from lightning_accel.config.parallelism import (
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from lightning_accel.config.project import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from lightning_accel.config.quantization import BnbQuantizationConfig

__all__ = [
    "AccelerateConfig",
    "AutocastKwargs",
    "BnbQuantizationConfig",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "MegatronLMPlugin",
    "ParallelismConfig",
    "ProjectConfiguration",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "load_config",
    "write_machine_config",
]
