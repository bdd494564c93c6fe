"""``acc_fsdp``: fully sharded data parallel (FSDP1 or FSDP2) on CPU or GPU, for the Trainer and Fabric.

The FSDP behaviour lives in :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily`; process groups, devices and
launching come from the DDP family these classes extend (which runs on CPU, unlike Lightning's own ``fsdp``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.strategies import FSDPStrategy as LightningFabricFSDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize_meta_tensors
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.checkpoint.engines import EngineCheckpoint, FSDPCheckpoint
from lightning_accel.config import FullyShardedDataParallelPlugin, InitProcessGroupKwargs, TorchDynamoPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.precision.fp8 import refresh_float8_scales
from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.fsdp_core import FSDPFamily, FSDPFamilyAdapter, checkpoint_value, load_target_error
from lightning_accel.strategies.fsdp_optimizers import check_sharded_parameters
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.utils.lightning_internals import (
    lightning_private,
    lightning_private_members,
    set_lightning_private,
)

_StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


@lightning_private_members("_configure_launcher", "_setup_model")
class AcceleratedFSDPStrategy(FSDPFamilyAdapter, AcceleratedDDPStrategy):
    """Trainer strategy that shards parameters, gradients and optimizer state across processes.

    Args:
        fsdp_plugin: Accelerate's FSDP settings (version, resharding, auto-wrap policy, offload, mixed precision,
            state-dict type, ...). ``None`` means FSDP2 with full sharding and sharded checkpoints.
        init_kwargs: Process-group options (collective backend, init method, timeout).
        dynamo_plugin: ``torch.compile`` settings applied to the model before it is sharded.
        strategy_name: The name shown in messages (set by the registry).
        accelerator: Passed to Lightning.
        parallel_devices: Passed to Lightning.
        cluster_environment: Passed to Lightning.
        checkpoint_io: Passed to Lightning (used for full-state-dict checkpoint files).
        precision_plugin: Passed to Lightning.
        start_method: How processes start, as for ``acc_ddp``.

    Checkpoints follow ``fsdp_plugin.state_dict_type``: ``FULL_STATE_DICT`` writes one file (gathered from every
    process, written by rank 0), ``SHARDED_STATE_DICT`` a directory of ``torch.distributed.checkpoint`` shards with
    ``meta.pt``. ``fit(ckpt_path=...)`` reads either.

    The model is sharded by the first entry point (``fit``, ``validate``, ``test`` or ``predict``) and stays sharded:
    later calls on the same Trainer run on the same sharded model, as Lightning's own ``fsdp`` does.

    """

    def __init__(
        self,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        *,
        init_kwargs: InitProcessGroupKwargs | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        strategy_name: str = "acc_fsdp",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        start_method: _StartMethod = "popen",
    ) -> None:
        self._fsdp = FSDPFamily(fsdp_plugin, dynamo_plugin)
        super().__init__(
            init_kwargs=init_kwargs,
            strategy_name=strategy_name,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            start_method=start_method,
        )
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
            layer_sync = lightning_private(self, "_layer_sync")
            if layer_sync:
                self.model = layer_sync.apply(self.model)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            sharded = self._sharded_model = self._setup_model(self.model)
        # An earlier evaluation may have left FSDP2 units gathered; the optimizer must get the sharded parameters.
        _reshard(sharded)
        self.model = sharded
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

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
    def on_validation_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_test_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._reshard_after_evaluation()

    def _reshard_after_evaluation(self) -> None:
        """Free the parameters FSDP2 gathered for gradient-free forwards (no backward pass reshards them)."""
        assert self.model is not None
        _reshard(self.model)

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
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._fsdp.adopt_precision(self.precision_plugin)

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        return self._fsdp.wrap(model, self.root_device, self.world_size, self.precision_plugin)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.model is not None
        for optimizer in self.optimizers:
            self._fsdp.refresh_float8_scales_after_steps(optimizer, [self.model])

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._fsdp.no_sync(self.model):
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    def _step(self, method: str, context: Callable[[], AbstractContextManager], *args: Any, **kwargs: Any) -> Any:
        """Run a step through the sharded model's ``forward`` so FSDP gathers parameters first.

        FSDP2 shards the LightningModule in place, so Lightning's own check (``model != lightning_module``) would
        skip the redirection and run the step on sharded parameters.
        """
        assert self.model is not None and self.lightning_module is not None
        with context():
            redirect = lightning_private(self, "_forward_redirection")
            return redirect(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self._fsdp.model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self._fsdp.optimizer_state_dict(self.model, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded the weights into the sharded model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded the optimizer states."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(filepath))
        if self._fsdp.full_state_dict:
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            self._fsdp.save_trainer_checkpoint(checkpoint, path, self.is_global_zero)
        self.barrier("acc_fsdp.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        return self._fsdp.load_trainer_checkpoint(path, self.model, optimizers, self.lightning_module.strict_loading)


class _FSDPBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, family: FSDPFamily) -> None:
        self._family = family

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._family.no_sync(module, enabled)


@lightning_private_members("_configure_launcher")
class FabricAcceleratedFSDPStrategy(FSDPFamilyAdapter, FabricAcceleratedDDPStrategy):
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
        self,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        *,
        init_kwargs: InitProcessGroupKwargs | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        strategy_name: str = "acc_fsdp",
        accelerator: FabricAccelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: FabricPrecision | None = None,
        start_method: _StartMethod = "popen",
    ) -> None:
        self._fsdp = FSDPFamily(fsdp_plugin, dynamo_plugin)
        super().__init__(
            init_kwargs=init_kwargs,
            strategy_name=strategy_name,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            start_method=start_method,
        )
        set_lightning_private(self, "_backward_sync_control", _FSDPBackwardSyncControl(self._fsdp))
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
        return FSDPCheckpoint(str(self.fsdp_plugin.state_dict_type), after_load=refresh_float8_scales)

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
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._fsdp.adopt_precision(self.precision)

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

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._fsdp.model_state_dict(module)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None or filter is not None:
            raise ValueError("acc_fsdp checkpoints take neither `storage_options` nor `filter`; drop them.")
        path = Path(self.broadcast(path))
        module = _single_module(state)
        converted = {
            key: self._fsdp.model_state_dict(value)
            if isinstance(value, Module)
            else self._fsdp.optimizer_state_dict(module, value)
            if isinstance(value, Optimizer)
            else checkpoint_value(value)
            for key, value in state.items()
        }
        if self._fsdp.full_state_dict:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(converted, path)
        else:
            shards = [k for k, v in state.items() if isinstance(v, (Module, Optimizer))]
            self._fsdp.save_sharded(converted, shards, path, self.is_global_zero)
        self.barrier("acc_fsdp.save_checkpoint")

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if isinstance(state, Module):  # fabric.load_raw(path, model): a plain full state-dict file
            self._fsdp.load_raw_module(Path(self.broadcast(path)), state, strict=strict)
            return {}
        if not isinstance(state, dict):
            raise ValueError(load_target_error("acc_fsdp", state))
        path = Path(self.broadcast(path))
        return self._fsdp.load_into(path, state, _single_module(state), strict=strict)


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


def _reshard(module: Module) -> None:
    """Register the sharded parameters again on every FSDP2 unit of ``module`` that holds gathered ones."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _single_module(state: dict[str, Any]) -> Module:
    modules = [v for v in state.values() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"acc_fsdp checkpoints hold exactly one sharded model, got {len(modules)} modules in the state;"
            " save each model to its own path."
        )
    return modules[0]


ENTRIES = (
    StrategyEntry(
        "acc_fsdp",
        AcceleratedFSDPStrategy,
        FabricAcceleratedFSDPStrategy,
        "Fully sharded data parallel (FSDP2 fully_shard or FSDP1) on CPU or GPU (FSDP)",
        DistributedType.FSDP,
    ),
)
