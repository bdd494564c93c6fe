"""Build the Lightning ``Fabric`` an ``Accelerator`` runs on: the launch, the strategy and the precision plugin.

Nothing here branches on the distributed type: the type comes from the process count, the device table
(:data:`~lightning_accel.config.devices.BACKEND_BY_DEVICE`) or the plugin given, and :func:`strategy_for` turns
it into the strategy object that does the work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from lightning_accel._accelerator.deepspeed import adopt_config_accumulation
from lightning_accel.config import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from lightning_accel.config._settings import PLUGIN_BY_TYPE
from lightning_accel.config.devices import backend_for_device
from lightning_accel.config.fp8 import AORecipeKwargs, FP8RecipeKwargs, TERecipeKwargs
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.launch_settings import torch_device_from_env
from lightning_accel.launch_settings.submitit import check_submitit_tasks
from lightning_accel.precision import precision_plugin
from lightning_accel.precision.base import AcceleratePrecision
from lightning_accel.state import GradientState
from lightning_accel.strategies import entry_for
from lightning_accel.strategies.lightning_arguments import keyword_names, takes_any_keyword
from lightning_accel.strategies.protocol import ShimStrategy
from lightning_accel.strategies.registry import StrategyEntry, entries
from lightning_accel.utils.deepspeed import DummyOptim, DummyScheduler

__all__ = ["Launch", "build_fabric", "describe_prepare_call", "detect_launch", "split_handlers"]

# Which constructor argument of a strategy or precision plugin each kwargs handler feeds.
_HANDLER_ARGUMENT: dict[type[KwargsHandler], str] = {
    DistributedDataParallelKwargs: "ddp_kwargs",
    InitProcessGroupKwargs: "init_kwargs",
    AutocastKwargs: "autocast_kwargs",
    GradScalerKwargs: "scaler_kwargs",
    ProfileKwargs: "profile_kwargs",  # read by Accelerator.profile, not by a strategy or precision plugin
    AORecipeKwargs: "recipe_kwargs",
    TERecipeKwargs: "recipe_kwargs",
    FP8RecipeKwargs: "recipe_kwargs",
}


@dataclass(frozen=True)
class Launch:
    """How many processes this run has, as the launcher (torchrun, SLURM, or none) describes it.

    Attributes:
        world_size: Processes in the whole run.
        local_world_size: Processes on this node.

    """

    world_size: int = 1
    local_world_size: int = 1

    @property
    def num_nodes(self) -> int:
        """Nodes in the run."""
        return max(1, self.world_size // self.local_world_size)


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """Detect a multi-process launch the way Lightning's cluster environments do.

    torchrun / torchelastic (``TORCHELASTIC_RUN_ID``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), a SLURM batch job
    (``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``), or a manual launch that sets ``WORLD_SIZE`` and ``LOCAL_RANK``
    (Lightning's default environment). Anything else is one process.

    Raises:
        ValueError: If the variables hold something other than positive integers, or in a task of a multi-task
            submitit local job without torch's variables (``check_submitit_tasks``).

    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:  # what torch.distributed.is_torchelastic_launched() checks
        world = _positive(env, "WORLD_SIZE", "1")
        return Launch(world, _positive(env, "LOCAL_WORLD_SIZE", str(world)))
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # as SLURMEnvironment
        world = _positive(env, "SLURM_NTASKS", "1")
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0]
        return Launch(world, _positive({"SLURM_NTASKS_PER_NODE": per_node}, "SLURM_NTASKS_PER_NODE", str(world)))
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        world = _positive(env, "WORLD_SIZE", "1")
        return Launch(world, _positive(env, "LOCAL_WORLD_SIZE", str(world)))
    check_submitit_tasks(env)
    return Launch()


def _positive(env: Mapping[str, str], name: str, default: str) -> int:
    text = env.get(name, default)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"Environment variable {name}={text!r} must be a positive integer (set by the launcher).")
    return value


def device_type(cpu: bool) -> str:
    """The device type to train on: ``cpu`` when asked, else ``ACCELERATE_TORCH_DEVICE``'s, else the machine's."""
    if cpu:
        return "cpu"
    env_device = torch_device_from_env()
    if env_device is not None:
        return env_device.type
    if not torch.accelerator.is_available():
        return "cpu"
    current = torch.accelerator.current_accelerator()
    return "cpu" if current is None else current.type


def recorded_device(fabric: Fabric, cpu: bool) -> torch.device:
    """The device the state records: ``ACCELERATE_TORCH_DEVICE`` where it names the Fabric's device type."""
    env_device = None if cpu else torch_device_from_env()
    if env_device is not None and env_device.type == fabric.device.type:
        return env_device
    return fabric.device


def _devices(device: str, launch: Launch) -> int | list[int]:
    """Processes per node, or the one index ``ACCELERATE_TORCH_DEVICE`` names for a single-process run."""
    env = torch_device_from_env()
    if launch.local_world_size == 1 and device != "cpu" and env is not None and env.type == device:
        return launch.local_world_size if env.index is None else [env.index]
    return launch.local_world_size


def distributed_type(launch: Launch, device: str, plugins: Mapping[str, Any]) -> DistributedType:
    """The Accelerate type: the given plugin's family, else ``NO`` for one process, else the device's DDP type.

    Raises:
        ValueError: If plugins of two families are given.

    """
    chosen = [dtype for dtype, entry in PLUGIN_BY_TYPE.items() if plugins.get(entry.option) is not None]
    if len(chosen) > 1:
        raise ValueError(f"Pass at most one of {', '.join(PLUGIN_BY_TYPE[t].option for t in chosen)}; got several.")
    if chosen:
        return chosen[0]
    if launch.world_size == 1:
        return DistributedType.NO
    return backend_for_device(device).distributed_type


def split_handlers(handlers: Sequence[KwargsHandler] | None) -> dict[str, KwargsHandler]:
    """Map each kwargs handler to the constructor argument it feeds (``ddp_kwargs=``, ``scaler_kwargs=``, ...).

    Raises:
        TypeError: For an object that is not a supported kwargs handler.
        ValueError: For two handlers of the same kind.

    """
    found: dict[str, KwargsHandler] = {}
    for handler in handlers or ():
        argument = _HANDLER_ARGUMENT.get(type(handler))
        if argument is None:
            supported = ", ".join(cls.__name__ for cls in _HANDLER_ARGUMENT)
            raise TypeError(f"Unsupported kwargs handler {handler!r}; supported: {supported}.")
        if argument in found:
            first, second = type(found[argument]).__name__, type(handler).__name__
            kinds = f"two {first} objects" if first == second else f"{first} and {second}, which configure one thing"
            raise ValueError(f"kwargs_handlers holds {kinds}; pass only one.")
        found[argument] = handler
    return found


def _accepted(cls: type, options: Mapping[str, Any], *, open_kwargs: bool = False) -> dict[str, Any]:
    """The ``options`` that ``cls.__init__`` takes: a handler applies only where its settings mean something.

    With ``open_kwargs``, a class taking ``**kwargs`` takes every option (it says itself which it refuses).
    """
    if open_kwargs and takes_any_keyword(cls):
        return dict(options)
    names = keyword_names(cls)
    return {name: value for name, value in options.items() if name in names}


def build_fabric(
    dtype: DistributedType,
    device: str,
    launch: Launch,
    *,
    mixed_precision: str,
    handlers: Mapping[str, KwargsHandler],
    plugins: Mapping[str, Any],
) -> Fabric:
    """Create and launch the ``Fabric`` for ``dtype`` (this sets up the process group when there are several).

    Args:
        dtype: The Accelerate distributed type.
        device: The device type (``"cpu"``, ``"cuda"``, ...).
        launch: The processes the launcher started.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        handlers: Kwargs handlers by the argument they feed (see :func:`split_handlers`).
        plugins: ``fsdp_plugin``/``deepspeed_plugin``/``dynamo_plugin`` objects (``None`` values are dropped).

    A strategy that takes ``gradient_accumulation_steps`` (DeepSpeed, whose engine divides the loss itself) gets
    the accumulation of the shared :class:`~lightning_accel.state.GradientState`, which the ``Accelerator`` sets up
    before launching.

    Raises:
        ValueError: For a type without a strategy. fp16 on CPU trains in fp32 with a warning, as in Accelerate
            (whose scripts ask for fp16 whatever the machine).

    """
    given = {name: value for name, value in plugins.items() if value is not None}
    adopt_config_accumulation(given.get("deepspeed_plugin"), GradientState())
    loop = {"gradient_accumulation_steps": GradientState().num_steps}
    entry = _strategy_entry(dtype, given)
    strategy_options = _accepted(entry.fabric_cls, given, open_kwargs=True)
    refused = sorted(set(given) - set(strategy_options))
    if refused:
        raise ValueError(
            f"{entry.name} does not take {', '.join(refused)}: drop {'it' if len(refused) == 1 else 'them'}, or"
            f" {'drop parallelism_config' if 'parallelism_config' in given else 'pick another plugin'}."
        )
    strategy_options.update(_accepted(entry.fabric_cls, {**handlers, **loop}))
    strategy = entry.fabric_cls(**entry.params(**strategy_options))
    if mixed_precision == PrecisionType.FP16 and device == "cpu" and dtype != DistributedType.DEEPSPEED:
        warnings.warn(
            "mixed_precision='fp16' needs a GPU: this CPU run trains in fp32, as Accelerate's does. Use"
            " mixed_precision='bf16' for mixed precision on CPU.",
            UserWarning,
            stacklevel=4,
        )
        mixed_precision = PrecisionType.NO.value
    precision_cls = type(precision_plugin(mixed_precision))
    precision: AcceleratePrecision = precision_cls(**_accepted(precision_cls, _precision_options(handlers)))
    fabric = Fabric(
        accelerator=device,
        devices=_devices(device, launch),
        num_nodes=launch.num_nodes,
        strategy=strategy,
        plugins=[precision],
    )
    fabric.launch()
    return fabric


def _precision_options(handlers: Mapping[str, KwargsHandler]) -> dict[str, Any]:
    """The handlers for the precision plugin, with the fp8 ``backend`` that a recipe's class names."""
    options: dict[str, Any] = dict(handlers)
    recipe = handlers.get("recipe_kwargs")
    if recipe is not None:
        options["backend"] = "ao" if isinstance(recipe, AORecipeKwargs) else "te"
    return options


def _strategy_entry(dtype: DistributedType, plugins: Mapping[str, Any]) -> StrategyEntry:
    """``acc_parallel`` when a ``parallelism_config`` is given (it composes FSDP2 with the mesh), else ``dtype``'s."""
    if plugins.get("parallelism_config") is None:
        return entry_for(dtype)
    return next(entry for entry in entries() if entry.name == "acc_parallel")


def describe_prepare_call(strategy: ShimStrategy, objects: Sequence[Any], split_batches: bool) -> None:
    """Tell the strategy what a ``prepare`` call holds (DeepSpeed's engine config depends on it).

    Strategies answer through ``configure_from_prepare`` (most have nothing to configure). Only calls that set up a
    model build an engine, so only they are described (Accelerate's ``prepare`` reads the same objects, including
    ``DummyOptim`` / ``DummyScheduler``).
    """
    if not any(isinstance(obj, Module) for obj in objects):
        return
    optimizers = [obj for obj in objects if isinstance(obj, Optimizer)]
    schedulers = [obj for obj in objects if isinstance(obj, (LRScheduler, DummyScheduler))]
    strategy.configure_from_prepare(
        _batch_sizes([obj for obj in objects if isinstance(obj, DataLoader)]),
        split_batches=split_batches,
        torch_optimizer=any(not isinstance(obj, DummyOptim) for obj in optimizers),
        optimizer=optimizers[-1] if optimizers else None,  # the last of each, as Accelerate reads the call
        scheduler=schedulers[-1] if schedulers else None,
    )


def _batch_sizes(loaders: Sequence[DataLoader]) -> list[int | None]:
    """Each loader's ``batch_size``, else its batch sampler's (``None`` where neither is an int)."""
    sizes: list[int | None] = []
    for loader in loaders:
        size = loader.batch_size
        if size is None:
            size = getattr(loader.batch_sampler, "batch_size", None)
        sizes.append(size if isinstance(size, int) else None)
    return sizes
