"""lightning_accel: Hugging Face Accelerate's model of distributed training inside PyTorch Lightning.

Importing the package registers every ``acc_*`` strategy name in both the Trainer's and Fabric's strategy registries
(and accelerators for devices Lightning has none for), so ``Trainer(strategy="acc_multi_cpu")`` works right after
``import lightning_accel``. Heavy optional backends (deepspeed, wandb, torchao, transformer_engine, torch_xla) are
imported only when a feature that needs them is used.
"""

from lightning_accel.accelerator import Accelerator
from lightning_accel.big_modeling import (
    attach_layerwise_casting_hooks,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from lightning_accel.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ParallelismConfig,
)
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.data_loader import skip_first_batches
from lightning_accel.enums import DDPCommunicationHookType, DistributedType, PrecisionType
from lightning_accel.inference import prepare_pippy
from lightning_accel.launchers import debug_launcher, notebook_launcher
from lightning_accel.state import AcceleratorState, GradientState, PartialState
from lightning_accel.strategies import register_strategies, strategy_for
from lightning_accel.strategies.accelerators import register_accelerators
from lightning_accel.strategies.from_settings import trainer_kwargs
from lightning_accel.utils.imports import is_rich_available
from lightning_accel.utils.memory import find_executable_batch_size
from lightning_accel.utils.modeling import (
    infer_auto_device_map,
    load_checkpoint_in_model,
)
from lightning_accel.utils.random import synchronize_rng_states

__version__ = "0.1.0"
accelerate_api_version = "1.15.0"
"""The Hugging Face Accelerate release whose API this package implements (what ``accelerate.__version__`` would be).

Code written for Accelerate that gates features on ``accelerate.__version__`` (diffusers' training scripts register
their checkpoint hooks only from 0.16.0) should compare this instead of ``lightning_accel.__version__``.
"""

register_accelerators()
register_strategies()


def _publish_deepspeed_wrappers() -> None:
    """Give ``lightning_accel.utils`` (and ``.utils.deepspeed``) the shim's DeepSpeed wrappers, as Accelerate has them.

    ``accelerate.utils.DeepSpeedOptimizerWrapper`` / ``DeepSpeedSchedulerWrapper`` subclass the shim's optimizer and
    scheduler, which ``utils`` sits below and may not import; the package root, above every layer, hands them over
    (``transformers.Trainer`` imports them from ``accelerate.utils`` whenever DeepSpeed is installed).
    """
    from lightning_accel import utils
    from lightning_accel.optimizer import DeepSpeedOptimizerWrapper
    from lightning_accel.scheduler import DeepSpeedSchedulerWrapper
    from lightning_accel.utils import deepspeed

    for module in (utils, deepspeed):
        for wrapper in (DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper):
            setattr(module, wrapper.__name__, wrapper)  # documented with their own modules, not in utils.__all__


_publish_deepspeed_wrappers()

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientState",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "PrecisionType",
    "ProfileKwargs",
    "__version__",
    "accelerate_api_version",
    "attach_layerwise_casting_hooks",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "prepare_pippy",
    "skip_first_batches",
    "strategy_for",
    "synchronize_rng_states",
    "trainer_kwargs",
]
