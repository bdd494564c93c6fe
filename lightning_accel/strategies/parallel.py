"""``acc_parallel``: Accelerate's ``ParallelismConfig`` (dp_replicate x dp_shard x cp x tp) for the Trainer and Fabric.

Both classes extend Lightning's ``ModelParallelStrategy`` (FSDP2 + tensor parallelism on a ``DeviceMesh``, launching,
collectives) and replace its 2-D ``data_parallel x tensor_parallel`` mesh with Accelerate's N-D mesh. The behaviour
lives once in :class:`~lightning_accel.strategies.parallel_core.ParallelFamily`.

In a LightningModule, ``configure_model`` sees the mesh as ``self.device_mesh`` and may apply ``parallelize_module``
to ``self.device_mesh["tp"]``; afterwards the strategy shards the module with FSDP2 over ``dp_shard_cp`` (HSDP with
``dp_replicate``), unless ``configure_model`` already called ``fully_shard``. With Fabric, ``parallelize_fn(module,
mesh)`` plays the part of ``configure_model``. Both also take a ``tp_plan`` they apply themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallelStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallelStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_accel.config import ParallelismConfig
from lightning_accel.lightning_compat import (
    get_device_mesh,
    get_parallelize_fn,
    lightning_private_members,
    set_device_mesh,
)
from lightning_accel.strategies.parallel_core import ParallelFamilyAdapter, ParallelOptions
from lightning_accel.strategies.precision_adoption import translating
from lightning_accel.strategies.protocol import ProcessGroupShards, ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.strategies.sharded_adapter import ShardedFabricAdapter, ShardedTrainerAdapter, reshard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ParallelizeFn = Callable[[Module, "DeviceMesh"], Module]


class FabricParallelArgs(ParallelOptions, total=False):
    """The keyword arguments of :class:`FabricAcceleratedParallelStrategy`."""

    parallelize_fn: ParallelizeFn | None


@lightning_private_members("_configure_launcher", "_setup_distributed")
class AcceleratedParallelStrategy(ParallelFamilyAdapter, ShardedTrainerAdapter, _TrainerModelParallelStrategy):
    """Trainer strategy for N-D parallelism from a :class:`~lightning_accel.config.ParallelismConfig`.

    Args:
        parallelism_config: The sizes of ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``; their product must be the
            number of processes. ``None`` replicates over all processes.
        fsdp_plugin: FSDP2 settings for the shard dimensions; its ``state_dict_type`` chooses sharded
            (``torch.distributed.checkpoint`` directory, the default) or full (one file) checkpoints.
        tp_plan: A ``parallelize_module`` plan for the ``tp`` dimension, applied after ``configure_model``.
        strategy_name: The name shown in messages (set by the registry).
        process_group_backend: Collective backend; ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.

    Example:
        >>> import lightning as L
        >>> from lightning_accel.utils import ParallelismConfig
        >>> strategy = AcceleratedParallelStrategy(ParallelismConfig(dp_shard_size=2, tp_size=2))
        >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP

    """

    def __init__(self, parallelism_config: ParallelismConfig | None = None, **kwargs: Unpack[ParallelOptions]) -> None:
        super().__init__(**self._adopt_family(parallelism_config, kwargs))
        self._parallelized: Module | None = None

    precision_plugin = translating(_TrainerModelParallelStrategy.precision_plugin)

    @override
    def setup_environment(self) -> None:
        """Start the process group, build Accelerate's mesh and hand it to the LightningModule's ``device_mesh``."""
        self._setup_distributed()
        mesh = self._parallel.build_mesh(self.root_device.type)
        set_device_mesh(self, mesh)
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, mesh)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Parallelize the model ``configure_model`` built (once; later entry points reuse it), then the optimizers."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:
            self.model = self.precision_plugin.convert_module(self.model)
            self.model = self._parallel.parallelize(self.model, self.root_device, self.precision_plugin)
            self.model_to_device()
            self._parallelized = self.model
        reshard(self.model)
        self.barrier()
        self._setup_optimizers_on_shards(trainer)


@lightning_private_members("_configure_launcher", "_setup_distributed")
class FabricAcceleratedParallelStrategy(
    ProcessGroupShards, ParallelFamilyAdapter, ShardedFabricAdapter, _FabricModelParallelStrategy, ShimStrategyDefaults
):
    """Fabric twin of :class:`AcceleratedParallelStrategy`.

    Args:
        parallelism_config: As for the Trainer strategy.
        parallelize_fn: ``fn(module, device_mesh) -> module`` applying tensor parallelism (and, if it wants,
            ``fully_shard``) before the strategy shards what is left; ``None`` leaves it to ``tp_plan``.
        fsdp_plugin: As for the Trainer strategy.
        tp_plan: As for the Trainer strategy (applied after ``parallelize_fn``).
        strategy_name: The name shown in messages (set by the registry).
        process_group_backend: Collective backend; ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.

    ``fabric.setup(model, optimizer)`` takes an optimizer built from the plain model and points it at the
    parallelized parameters (Accelerate's one-call ``prepare``); ``setup_module`` then ``setup_optimizers`` works too.

    """

    def __init__(
        self, parallelism_config: ParallelismConfig | None = None, **kwargs: Unpack[FabricParallelArgs]
    ) -> None:
        parallelize_fn = kwargs.pop("parallelize_fn", None)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"`parallelize_fn` must be callable(module, device_mesh), got {parallelize_fn!r}.")
        lightning = self._adopt_family(parallelism_config, kwargs)
        super().__init__(parallelize_fn=parallelize_fn or _unchanged, **lightning)

    precision = translating(_FabricModelParallelStrategy.precision)

    @override
    def setup_environment(self) -> None:
        """Start the process group and build Accelerate's mesh (``device_mesh`` and ``torch_device_mesh``)."""
        self._setup_distributed()
        set_device_mesh(self, self._parallel.build_mesh(self.root_device.type))

    @override
    def setup_module(self, module: Module) -> Module:
        return self._parallel.parallelize(self._user_parallelized(module), self.root_device, self.precision)

    def mesh_rank(self, dimension: str) -> int:
        """The coordinate of this process along the mesh's ``dimension`` (0 where the mesh lacks it)."""
        return self._parallel.rank(dimension)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """Parallelize ``module`` and point ``optimizers``, built from its plain parameters, at the new ones.

        Raises:
            ValueError: As :meth:`~lightning_accel.strategies.parallel_core.ParallelFamily.parallelize`, or if an
                optimizer holds a tensor that is not a parameter of ``module``.

        """
        from lightning_accel.strategies.fsdp_optimizers import optimizer_parameter_names, repoint_optimizers

        names = optimizer_parameter_names(module, optimizers)
        parallel = self.setup_module(module)
        repoint_optimizers(parallel, optimizers, names)
        return parallel, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def _user_parallelized(self, module: Module) -> Module:
        if self.device_mesh is None:
            return module
        result = get_parallelize_fn(self)(module, self.device_mesh)
        if not isinstance(result, Module):
            raise TypeError(f"`parallelize_fn` must return the nn.Module, got {type(result).__name__}.")
        return result

    @property
    @override
    def device_mesh(self) -> DeviceMesh:  # None with a single process
        mesh: DeviceMesh = get_device_mesh(self)
        return mesh


def _unchanged(module: Module, mesh: Any) -> Module:
    return module


ENTRIES = (
    StrategyEntry(
        "acc_parallel",
        AcceleratedParallelStrategy,
        FabricAcceleratedParallelStrategy,
        "N-D parallelism from Accelerate's ParallelismConfig (dp_replicate x dp_shard/FSDP2 x cp x tp on a DeviceMesh)",
    ),
)
