"""``acc_fsdp``: fully sharded data parallel (FSDP1 or FSDP2) on CPU or GPU, for the Trainer and Fabric.

The FSDP behaviour lives in :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily`; process groups, devices and
launching come from the DDP family these classes extend (which runs on CPU, unlike Lightning's own ``fsdp``).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.strategies import FSDPStrategy as LightningFabricFSDPStrategy
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize_meta_tensors
from lightning.pytorch import Trainer
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_accel.checkpoint.engines import EngineCheckpoint
from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint
from lightning_accel.config import FullyShardedDataParallelPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import (
    get_layer_sync,
    lightning_private_members,
    set_backward_sync_control,
)
from lightning_accel.precision.fp8 import refresh_float8_scales
from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.fsdp_core import FSDPFamilyAdapter, FSDPOptions
from lightning_accel.strategies.fsdp_optimizers import check_sharded_parameters
from lightning_accel.strategies.lightning_arguments import FabricPlugins, ParallelArguments, TrainerPlugins
from lightning_accel.strategies.protocol import ContextBackwardSync
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.strategies.sharded_adapter import ShardedFabricAdapter, ShardedTrainerAdapter, reshard


class TrainerFSDPArgs(FSDPOptions, ParallelArguments, TrainerPlugins, total=False):
    """The keyword arguments of :class:`AcceleratedFSDPStrategy`."""


class FabricFSDPArgs(FSDPOptions, ParallelArguments, FabricPlugins, total=False):
    """The keyword arguments of :class:`FabricAcceleratedFSDPStrategy`."""


@lightning_private_members("_configure_launcher", "_setup_model")
class AcceleratedFSDPStrategy(FSDPFamilyAdapter, ShardedTrainerAdapter, AcceleratedDDPStrategy):
    """Trainer strategy that shards parameters, gradients and optimizer state across processes.

    Args:
        fsdp_plugin: Accelerate's FSDP settings (version, resharding, auto-wrap policy, offload, mixed precision,
            state-dict type, ...). ``None`` means FSDP2 with full sharding and sharded checkpoints.
        init_kwargs: Process-group options (collective backend, init method, timeout).
        dynamo_plugin: ``torch.compile`` settings applied to the model before it is sharded.
        strategy_name: The name shown in messages (set by the registry).
        checkpoint_io: Lightning's checkpoint I/O, for full-state-dict checkpoint files; by default ``torch.save``
            files, an unreadable one named in the error.
        start_method: How processes start, as for ``acc_ddp``.
        **kwargs: The keyword settings above, and Lightning's ``accelerator``, ``parallel_devices``,
            ``cluster_environment`` and ``precision_plugin`` (the Trainer sets them when left out).

    Checkpoints follow ``fsdp_plugin.state_dict_type``: ``FULL_STATE_DICT`` writes one file (gathered from every
    process, written by rank 0), ``SHARDED_STATE_DICT`` a directory of ``torch.distributed.checkpoint`` shards with
    ``meta.pt``. ``fit(ckpt_path=...)`` reads either.

    The model is sharded by the first entry point (``fit``, ``validate``, ``test`` or ``predict``) and stays sharded:
    later calls on the same Trainer run on the same sharded model, as Lightning's own ``fsdp`` does.

    """

    def __init__(
        self, fsdp_plugin: FullyShardedDataParallelPlugin | None = None, **kwargs: Unpack[TrainerFSDPArgs]
    ) -> None:
        super().__init__(**self._adopt_fsdp(fsdp_plugin, kwargs))
        self._sharded_model: Module | None = None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def setup(self, trainer: Trainer) -> None:
        """Shard the LightningModule at the first entry point, in every stage; reuse the sharded model afterwards.

        Each ``fit``/``validate``/``test``/``predict`` hands the strategy the LightningModule again. One this strategy
        sharded before (FSDP2 shards it in place, FSDP1 wraps it) is neither converted, moved nor sharded again.
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        sharded = self._sharded_model_of(self.model)
        if sharded is None:
            layer_sync = get_layer_sync(self)
            if layer_sync:
                self.model = layer_sync.apply(self.model)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            sharded = self._sharded_model = self._setup_model(self.model)
        # An earlier evaluation may have left FSDP2 units gathered; the optimizer must get the sharded parameters.
        reshard(sharded)
        self.model = sharded
        self._setup_optimizers_on_shards(trainer)

    def _sharded_model_of(self, module: Module) -> Module | None:
        """The sharded model ``module`` already is (FSDP2, or sharded by the user) or is wrapped in (FSDP1), if any."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            return module
        previous = self._sharded_model
        if isinstance(previous, FullyShardedDataParallel) and previous.module is module:
            return previous
        return None

    @override
    def teardown(self) -> None:
        """Leave the sharded model as it is (on its devices, with its synchronized layers) for the next entry point.

        Lightning's DDP moves the LightningModule to CPU and reverts ``sync_batchnorm`` here; both would break the
        shards the next ``validate``/``test``/``predict``/``fit`` reuses.
        """
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        return self._fsdp.wrap(model, self.root_device, self.world_size, self.precision_plugin)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.model is not None
        for optimizer in self.optimizers:
            self._fsdp.refresh_float8_scales_after_steps(optimizer, [self.model])

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded the weights into the sharded model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded the optimizer states."""


@lightning_private_members("_configure_launcher")
class FabricAcceleratedFSDPStrategy(FSDPFamilyAdapter, ShardedFabricAdapter, FabricAcceleratedDDPStrategy):
    """Fabric twin of :class:`AcceleratedFSDPStrategy` (``precision`` instead of ``precision_plugin``).

    Sharding replaces the model's parameters. ``fabric.setup(model, optimizer)`` (Accelerate's one-call
    ``prepare(model, optimizer, ...)``) takes an optimizer built from the unsharded model and points its param groups
    at the sharded parameters; ``model = fabric.setup_module(model)`` followed by
    ``fabric.setup_optimizers(SGD(model.parameters()))`` works as well.

    It keeps the contract of Lightning's Fabric ``FSDPStrategy``, and is registered as its virtual subclass, so code
    that asks ``isinstance(fabric.strategy, FSDPStrategy)`` (litgpt) takes its FSDP path: ``fabric.init_module(
    empty_init=True)`` creates the model on the meta device and setup materializes it with each module's
    ``reset_parameters()``; ``fabric.load_raw(path, model)`` loads a full state-dict file into the shards; stateful
    objects in ``fabric.save``/``fabric.load`` states are saved with ``state_dict()`` and restored with
    ``load_state_dict()``.
    """

    def __init__(
        self, fsdp_plugin: FullyShardedDataParallelPlugin | None = None, **kwargs: Unpack[FabricFSDPArgs]
    ) -> None:
        super().__init__(**self._adopt_fsdp(fsdp_plugin, kwargs))
        set_backward_sync_control(self, ContextBackwardSync(self._fsdp.no_sync))
        self._sharded_modules: weakref.WeakSet[Module] = weakref.WeakSet()

    @property
    @override
    def precision(self) -> FabricPrecision:
        return _FABRIC_DDP_PRECISION.fget(self)  # type: ignore[misc]

    @precision.setter
    def precision(self, precision: FabricPrecision | None) -> None:
        _FABRIC_DDP_PRECISION.fset(self, _fp16_on_cpu_as_bf16(precision, self.accelerator))  # type: ignore[misc]

    def checkpoint_engine(self) -> EngineCheckpoint | None:
        """FSDP writes ``save_state``'s models and optimizers (sharded or gathered, by the plugin's type)."""
        plugin = self.fsdp_plugin
        return FSDPCheckpoint(
            str(plugin.state_dict_type),
            after_load=refresh_float8_scales,
            state_dict_config=plugin.state_dict_config,
            optim_state_dict_config=plugin.optim_state_dict_config,
        )

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create the model on the meta device with ``empty_init=True`` (materialized by setup), else as DDP does."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: Module) -> None:
        """Move ``module`` to this process's device, unless it is still on the meta device (setup materializes it)."""
        if not _has_meta_device_parameters_or_buffers(module):
            super().module_to_device(module)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """Shard ``module`` and point ``optimizers``, built from its unsharded parameters, at the sharded ones.

        Raises:
            ValueError: As :meth:`~lightning_accel.strategies.fsdp_core.FSDPFamily.wrap_with_optimizers` does.

        """
        self._materialize(module)
        sharded = self._fsdp.wrap_with_optimizers(module, optimizers, self.root_device, self.world_size, self.precision)
        self._sharded_modules.add(sharded)
        return sharded, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]
        self._materialize(module)
        sharded = self._fsdp.wrap(module, self.root_device, self.world_size, self.precision)
        self._sharded_modules.add(sharded)
        return sharded

    def _materialize(self, module: Module) -> None:
        """Allocate a model made under ``init_module(empty_init=True)`` and initialize it with ``reset_parameters()``.

        Raises:
            TypeError: If a module with meta-device tensors has no ``reset_parameters`` (as in Lightning's FSDP).

        """
        if _has_meta_device_parameters_or_buffers(module):
            _materialize_meta_tensors(module, self.root_device)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Take an optimizer over the parameters of the sharded models.

        Raises:
            ValueError: If it holds a tensor that none of the models this strategy sharded has.

        """
        check_sharded_parameters(optimizer, self._sharded_modules)
        self._fsdp.refresh_float8_scales_after_steps(optimizer, self._sharded_modules)
        return super().setup_optimizer(optimizer)


# Code that checks for Lightning's Fabric FSDP (litgpt's checkpoint loading and weight initialization) takes its
# FSDP path under acc_fsdp. Only isinstance changes: no behaviour is inherited from Lightning's class.
LightningFabricFSDPStrategy.register(FabricAcceleratedFSDPStrategy)


_FABRIC_DDP_PRECISION: property = FabricAcceleratedDDPStrategy.precision


def _fp16_on_cpu_as_bf16(precision: Any, accelerator: Any) -> Any:
    """Lightning's rewrite of ``precision="16-mixed"`` on CPU to ``"bf16-mixed"``, for the ``FSDPPrecision`` path.

    Fabric's connector rewrites the string (with a warning) only for strategies it does not take for FSDP; for an
    ``FSDPStrategy`` (acc_fsdp is a virtual one) it builds ``FSDPPrecision("16-mixed")``, which fp16 on CPU cannot run.
    """
    from lightning.fabric.accelerators import CPUAccelerator
    from lightning.fabric.plugins.precision import FSDPPrecision
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    if (
        type(precision) is FSDPPrecision
        and precision.precision == "16-mixed"
        and isinstance(accelerator, CPUAccelerator)
    ):
        rank_zero_warn(
            "You passed `Fabric(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on "
            "CPU. Using `precision='bf16-mixed'` instead."
        )
        return FSDPPrecision("bf16-mixed")
    return precision


ENTRIES = (
    StrategyEntry(
        "acc_fsdp",
        AcceleratedFSDPStrategy,
        FabricAcceleratedFSDPStrategy,
        "Fully sharded data parallel (FSDP2 fully_shard or FSDP1) on CPU or GPU (FSDP)",
        DistributedType.FSDP,
    ),
)
