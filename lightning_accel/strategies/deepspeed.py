"""DeepSpeed strategies (``acc_deepspeed``, ``acc_deepspeed_stage_1`` ... ``acc_deepspeed_stage_3_offload``).

The behaviour lives in :class:`~lightning_accel.strategies.deepspeed_core.DeepSpeedFamily`; the two classes here adapt
it to Lightning's own ``DeepSpeedStrategy`` classes for the Trainer and Fabric, which they subclass so that Lightning
picks its DeepSpeed precision plugin and checkpoint handling for them. Unlike Lightning's, they run on CPU (DeepSpeed's
CPU accelerator over gloo) as well as CUDA, are configured by a :class:`~lightning_accel.config.DeepSpeedPlugin`, and
under the Trainer give the numbers of ``ddp`` with gradient accumulation too (see
:meth:`AcceleratedDeepSpeedStrategy.block_backward_sync`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import DeepSpeedPrecision as FabricDeepSpeedPrecision
from lightning.fabric.strategies import DeepSpeedStrategy as _FabricDeepSpeedStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.plugins import DeepSpeedPrecision as TrainerDeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy as _TrainerDeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import Unpack, override

from lightning_accel.checkpoint.engines import DeepSpeedCheckpoint, EngineCheckpoint
from lightning_accel.config import DeepSpeedPlugin, InitProcessGroupKwargs, TorchDynamoPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import (
    fabric_forward_module,
    get_config_initialized,
    get_data_source,
    get_deepspeed_engine,
    get_trainer,
    lightning_private_members,
    set_backward_sync_control,
    set_config_initialized,
)
from lightning_accel.strategies.checkpoint_io import (
    NamingTorchCheckpointIO,
    refuse_async_checkpoint_io,
    resolve_weights_only,
)
from lightning_accel.strategies.deepspeed_core import (
    DeepSpeedFamily,
    TrainingFacts,
    estimated_total_steps,
    process_group_settings,
)
from lightning_accel.strategies.deepspeed_fp8 import facts_precision
from lightning_accel.strategies.deepspeed_prepare import (
    PrepareFacts,
    check_dummies,
    dummy_fills,
    resolve_prepare_config,
)
from lightning_accel.strategies.lightning_arguments import (
    FabricPlugins,
    ParallelArguments,
    TrainerPlugins,
    check_keywords,
)
from lightning_accel.strategies.placement import ClusterPlacement
from lightning_accel.strategies.precision_adoption import bind_precision, deepspeed_translating, strategy_precision
from lightning_accel.strategies.protocol import (
    ContextBackwardSync,
    ProcessGroupShards,
    ShimStrategyDefaults,
    StepEngine,
)
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.strategies.subprocess_launch import FollowsTheLauncher
from lightning_accel.utils.deepspeed import DummyOptim
from lightning_accel.utils.modeling.checkpoint import (
    check_deepspeed_files,
    consolidate_deepspeed_checkpoint,
    deepspeed_tag_folder,
    read_checkpoint_file,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "AcceleratedDeepSpeedStrategy",
    "FabricAcceleratedDeepSpeedStrategy",
    "consolidate_deepspeed_checkpoint",
]


def check_deepspeed_folder(path: _PATH, weights_only: bool | None) -> None:
    """Check a DeepSpeed checkpoint folder before DeepSpeed unpickles it in full.

    Its ``latest`` tag must stay inside it, and each file of the tag must load weights-only (unless
    ``weights_only=False``, which warns naming each file). A path that is no DeepSpeed folder (a single
    full-weights file) is left to the checkpoint I/O, which reads it weights-only itself.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
        ValueError: If the ``latest`` tag names a folder outside ``path``.

    """
    folder = Path(path)
    if folder.is_dir() and (folder / "latest").is_file():
        check_deepspeed_files(deepspeed_tag_folder(folder), resolve_weights_only(weights_only))


class _OnDevices(Protocol):
    _family: DeepSpeedFamily
    _lightning_deepspeed: type

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    @property
    def root_device(self) -> torch.device: ...


class DeepSpeedOptions(TypedDict, total=False):
    """``acc_deepspeed``'s settings besides ``deepspeed_plugin`` (see :class:`AcceleratedDeepSpeedStrategy`)."""

    plugin_fields: Mapping[str, Any] | None
    dynamo_plugin: TorchDynamoPlugin | None
    strategy_name: str
    process_group_backend: str | None
    timeout: timedelta | None
    init_kwargs: InitProcessGroupKwargs | None
    remote_device: str | None
    load_full_weights: bool
    exclude_frozen_parameters: bool
    logging_level: int


class TrainerDeepSpeedArgs(DeepSpeedOptions, ParallelArguments, TrainerPlugins, total=False):
    """The keyword arguments of :class:`AcceleratedDeepSpeedStrategy`."""


class FabricDeepSpeedArgs(DeepSpeedOptions, ParallelArguments, FabricPlugins, total=False):
    """The keyword arguments of :class:`FabricAcceleratedDeepSpeedStrategy`."""

    gradient_accumulation_steps: int | None


_FAMILY_KEYS = ("plugin_fields", "dynamo_plugin", "strategy_name", "init_kwargs", "gradient_accumulation_steps")


class _DeepSpeedFamilyAdapter(ClusterPlacement, FollowsTheLauncher):
    """What the Trainer and Fabric DeepSpeed strategies share, read from their ``_family`` (before Lightning's).

    The root device comes from the cluster environment's local rank (:mod:`.placement`); Lightning's DeepSpeed
    strategy already sizes the sampler by the world size.
    """

    _family: DeepSpeedFamily

    def _adopt_family(self, plugin: DeepSpeedPlugin | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """Build the strategy's :class:`DeepSpeedFamily`; the arguments for Lightning's ``DeepSpeedStrategy``."""
        check_keywords(self, options)
        name = options.get("strategy_name") or "acc_deepspeed"
        self._family = DeepSpeedFamily(name, plugin, options.get("plugin_fields"), options.get("dynamo_plugin"))
        lightning = {key: value for key, value in options.items() if key not in _FAMILY_KEYS}
        backend, timeout = process_group_settings(
            options.get("init_kwargs"), options.get("process_group_backend"), options.get("timeout", default_pg_timeout)
        )
        return {**lightning, "config": self._family.config, "process_group_backend": backend, "timeout": timeout}

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin:
        """The DeepSpeed settings this strategy runs with."""
        return self._family.plugin

    @property
    def distributed_type(self) -> DistributedType:
        """Always ``DistributedType.DEEPSPEED``."""
        return DistributedType.DEEPSPEED

    def _configure_launcher(self: _OnDevices) -> None:
        bind_precision(strategy_precision(self), self.parallel_devices)  # refuses fp8 where it cannot run
        super()._configure_launcher()  # type: ignore[misc]  # FollowsTheLauncher's, then Lightning's

    def setup_environment(self: _OnDevices) -> None:
        """Check and claim the devices (CPU ones too), then Lightning's setup past its DeepSpeed class.

        That class's only addition here is refusing every accelerator but CUDA.
        """
        self._family.prepare_devices(self.parallel_devices, self.root_device)
        super(self._lightning_deepspeed, self).setup_environment()  # type: ignore[arg-type]


@lightning_private_members(
    "_configure_launcher",
    "_format_config",
    "_initialize_deepspeed_train",
    "_initialize_deepspeed_inference",
    "_setup_model_and_optimizer",
    "_init_config_if_needed",
    "_init_deepspeed_distributed",
    "_set_deepspeed_activation_checkpointing",
)
class AcceleratedDeepSpeedStrategy(_DeepSpeedFamilyAdapter, _TrainerDeepSpeedStrategy):
    """Trainer strategy running DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) on CPU or CUDA devices.

    The DeepSpeed config is the plugin's; its ``"auto"`` entries are filled from the Trainer (micro-batch size from
    the training DataLoader, ``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``, and the optimizer and
    scheduler from ``configure_optimizers`` when the config declares its own). Conflicts raise ``ValueError``.

    Lightning's loop decides which micro-batches accumulate, as it does for ``ddp``: DeepSpeed steps once per
    optimizer step (also on a shorter last window of an epoch), ``global_step`` counts optimizer steps, and the loss
    is divided by the accumulation steps once (Lightning's own DeepSpeed strategy divides it twice).

    Checkpoints are DeepSpeed directories (one shard per rank); with ``zero3_save_16bit_model=True`` they also hold
    the gathered weights as ``pytorch_model.bin``. :func:`consolidate_deepspeed_checkpoint` turns either into a full
    state dict.

    Args:
        deepspeed_plugin: The DeepSpeed settings; ``None`` means ``DeepSpeedPlugin()`` (ZeRO stage 2).
        plugin_fields: Fields for the plugin built when ``deepspeed_plugin`` is ``None`` (used by the
            ``acc_deepspeed_stage_*`` names).
        dynamo_plugin: ``torch.compile`` settings applied to the model before DeepSpeed wraps it.
        strategy_name: The name shown in messages (set by the registry).
        process_group_backend: The collective backend; by default gloo on CPU and NCCL on CUDA.
        timeout: Process-group timeout.
        init_kwargs: Accelerate's process-group options; its ``backend`` and ``timeout`` win over the two above.
        remote_device: Where ``deepspeed.zero.Init`` places new parameters (``"cpu"``, ``"nvme"``), ZeRO 3 only.
        load_full_weights: Resume ZeRO 3 from a single full checkpoint file instead of a DeepSpeed directory.
        exclude_frozen_parameters: Leave frozen parameters out of checkpoints.
        logging_level: Level of DeepSpeed's logger.
        **kwargs: The keyword settings above, and Lightning's ``accelerator``, ``parallel_devices``,
            ``cluster_environment`` and ``precision_plugin`` (the Trainer sets them when left out).

    Example:
        >>> import lightning as L
        >>> from lightning_accel.utils import DeepSpeedPlugin
        >>> trainer = L.Trainer(  # doctest: +SKIP
        ...     accelerator="cpu",
        ...     devices=2,
        ...     strategy=AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True)),
        ... )

    """

    #: :meth:`block_backward_sync` is DeepSpeed's step signal, not only a communication saving: a backward outside
    #: it reaches the accumulation boundary, where ZeRO replaces the gradients it reduced since the last boundary.
    #: Callbacks that skip the context to sync each batch must keep it here (ZeRO 2/3 reduce every micro-batch anyway).
    marks_step_boundary = True
    _lightning_deepspeed = _TrainerDeepSpeedStrategy

    def __init__(self, deepspeed_plugin: DeepSpeedPlugin | None = None, **kwargs: Unpack[TrainerDeepSpeedArgs]) -> None:
        super().__init__(**self._adopt_family(deepspeed_plugin, kwargs))
        self._engine: Any = None  # the engine the last entry point built, released by the next one
        self.checkpoint_io = NamingTorchCheckpointIO()  # a full-weights file that cannot be read is named

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's loading, weights-only (:func:`check_deepspeed_folder`), a file it cannot read named.

        Raises:
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
            ValueError: If the checkpoint cannot be read, naming it, or its ``latest`` tag is outside it.

        """
        check_deepspeed_folder(checkpoint_path, weights_only)
        parent = super().load_checkpoint
        return read_checkpoint_file(checkpoint_path, lambda path: parent(path, weights_only))

    precision_plugin = deepspeed_translating(_TrainerDeepSpeedStrategy.precision_plugin, TrainerDeepSpeedPrecision)

    @override
    def setup_distributed(self) -> None:
        # Lightning's device-index check ran in setup_environment (for CUDA only: CPU devices have no index).
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _format_config(self) -> None:
        module = self.lightning_module
        trainer = None if module is None else get_trainer(module)
        self.config = self._family.resolve(self._training_facts(trainer))
        accumulation = self.config["gradient_accumulation_steps"]
        if trainer is not None and trainer.accumulate_grad_batches != accumulation:
            rank_zero_info(f"{self._family.strategy_name}: accumulating {accumulation} batches per optimizer step.")
            trainer.accumulate_grad_batches = accumulation

    def _training_facts(self, trainer: pl.Trainer | None) -> TrainingFacts:
        device = self.root_device.type
        precision = facts_precision(self.precision_plugin)
        if trainer is None:
            return TrainingFacts(world_size=self.world_size, device_type=device, precision=precision)
        fitting = trainer.state.fn == TrainerFn.FITTING
        return TrainingFacts(
            world_size=self.world_size,
            device_type=device,
            precision=precision,
            micro_batch_size=self._train_batch_size(trainer) if fitting else None,
            micro_batch_size_required=fitting,
            accumulation=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
        )

    def _train_batch_size(self, trainer: pl.Trainer) -> int | None:
        source = get_data_source(trainer.fit_loop)
        if not source.is_defined():
            return None
        sizes = set(_batch_sizes(source.dataloader()))
        if not sizes:
            return None
        return min(sizes) if self._family.plugin.is_train_batch_min else max(sizes)

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        module = self.lightning_module
        assert module is not None
        self._release_engine()
        declared_optimizer = "optimizer" in self._family.config
        declared_scheduler = "scheduler" in self._family.config
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) > 1 or len(scheduler_configs) > 1:
            raise ValueError(
                f"DeepSpeed trains with one optimizer and at most one scheduler, but configure_optimizers returned"
                f" {len(optimizers)} optimizers and {len(scheduler_configs)} schedulers."
            )
        optimizer = None if isinstance(optimizers[0], _MockOptimizer) else optimizers[0]
        scheduler_config = scheduler_configs[0] if scheduler_configs else None
        if scheduler_config is not None and (declared_optimizer or declared_scheduler):
            declared = "a scheduler" if declared_scheduler else "an optimizer"
            raise ValueError(
                f"hf_ds_config declares {declared} and configure_optimizers returns a scheduler; DeepSpeed would"
                " replace the optimizer that scheduler drives. Declare both optimizer and scheduler in the config,"
                " or neither."
            )
        if optimizer is None and not declared_optimizer:
            raise ValueError(
                "configure_optimizers returned no optimizer and hf_ds_config declares none: return one from"
                " configure_optimizers, or add an 'optimizer' section to hf_ds_config."
            )
        total_steps = estimated_total_steps(module.trainer.estimated_stepping_batches) if declared_scheduler else None
        config = self._family.engine_config(model, optimizer, total_steps)
        engine, ds_optimizer, ds_scheduler = self._family.initialize(
            model, None if declared_optimizer else optimizer, self.local_rank, config
        )
        self._set_deepspeed_activation_checkpointing()
        self.optimizers = [ds_optimizer]
        if ds_scheduler is not None:
            engine.lr_scheduler = None  # Lightning steps it, once per optimizer step
            self.lr_scheduler_configs = [LRSchedulerConfig(ds_scheduler, interval="step")]
        elif scheduler_config is not None:
            self.lr_scheduler_configs = [scheduler_config]
        engine.set_gradient_accumulation_boundary(True)  # block_backward_sync marks the micro-batches that accumulate
        self.model = self._engine = engine

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        self._release_engine()
        remove_module_hooks(model)  # an engine of another Trainer may have left its hooks on the module
        config = self._family.inference_config()
        self.model, _, _ = self._family.initialize(model, None, self.local_rank, config)
        self._engine = self.model

    def _release_engine(self) -> None:
        """Release the engine an earlier ``fit``/``validate``/``test``/``predict`` built around the module.

        Each entry point builds its own engine (a training engine for ``fit``, one without optimizer otherwise) around
        the same LightningModule; the previous engine's hooks would otherwise keep running on it (and its optimizer
        state stay in memory). The module keeps its weights, partitioned as they are under ZeRO 3.
        """
        if self._engine is not None:
            self._family.release(self._engine)
            self._engine = None

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        config = self._family.engine_config(model, optimizer, None)
        engine, ds_optimizer, _ = self._family.initialize(model, optimizer, self.local_rank, config, lr_scheduler)
        return engine, ds_optimizer

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        self._init_config_if_needed()
        with self._family.sharded_init_context(self.remote_device):
            yield

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """``False``: the loop decides when to step, and :meth:`block_backward_sync` tells DeepSpeed."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients without reaching DeepSpeed's accumulation boundary."""
        with self._family.accumulating(self.model):
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's loop already divided the loss by the accumulation steps; DeepSpeed must not divide it again.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write DeepSpeed's checkpoint folder (and the full weights where the plugin asks for them).

        Raises:
            ValueError: If the checkpoint I/O saves in the background, which DeepSpeed's engine does not use.

        """
        refuse_async_checkpoint_io(self.checkpoint_io, "acc_deepspeed's checkpoint folder", _DEEPSPEED_ASYNC_FIX)
        filepath = self.broadcast(filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self._family.save_full_weights(self.deepspeed_engine, filepath)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register nothing: the ``acc_deepspeed*`` names come from lightning_accel's table."""


@lightning_private_members(
    "_configure_launcher",
    "_setup_distributed",
    "_set_world_ranks",
    "_init_deepspeed_distributed",
    "_format_config",
    "_initialize_engine",
)
class FabricAcceleratedDeepSpeedStrategy(
    ProcessGroupShards, _DeepSpeedFamilyAdapter, _FabricDeepSpeedStrategy, ShimStrategyDefaults
):
    """Fabric twin of :class:`AcceleratedDeepSpeedStrategy`.

    It takes the same arguments, with ``precision`` instead of ``precision_plugin``. Fabric has no clipping setting
    and no DataLoader at setup, so the config's ``"auto"`` entries for them become ``0`` and ``1`` (the micro-batch
    size only feeds DeepSpeed's throughput report); ``"auto"`` accumulation becomes ``gradient_accumulation_steps``
    (default ``1``); ``lightning_accel.Accelerator`` fills them by Accelerate's rules instead, through
    :meth:`configure_from_prepare`.
    Accumulation follows DeepSpeed's own rules: call ``fabric.backward(loss)`` and ``optimizer.step()`` for every
    micro-batch; the engine divides the loss by ``gradient_accumulation_steps`` and updates the weights on every
    ``gradient_accumulation_steps``-th call. Alternatively, as ``lightning_accel``'s ``Accelerator`` does, run the
    accumulating micro-batches inside ``fabric.no_backward_sync(model)``: they are then the non-boundary steps and the
    others the boundary ones, whatever DeepSpeed's counter says.

    Args:
        gradient_accumulation_steps: Micro-batches per optimizer step of the loop driving this strategy (the
            ``Accelerator``'s); it fills an ``"auto"`` config entry, and a config with another value is refused.
        **kwargs: As :class:`AcceleratedDeepSpeedStrategy`, with ``precision`` instead of ``precision_plugin``.

    Raises:
        ValueError: If ``gradient_accumulation_steps`` and the config's value differ.

    """

    #: The engine accumulates and steps inside ``backward``, and ``no_backward_sync`` is its step signal.
    engine_steps_in_backward = True
    marks_step_boundary = True
    _lightning_deepspeed = _FabricDeepSpeedStrategy

    def __init__(self, deepspeed_plugin: DeepSpeedPlugin | None = None, **kwargs: Unpack[FabricDeepSpeedArgs]) -> None:
        lightning = self._adopt_family(deepspeed_plugin, kwargs)
        self._accumulation = _loop_accumulation(self._family.config, kwargs.get("gradient_accumulation_steps"))
        super().__init__(**lightning)
        set_backward_sync_control(self, ContextBackwardSync(self._family.no_sync))
        self.checkpoint_io = NamingTorchCheckpointIO()
        self._scheduler_callable: Any = None  # a DummyScheduler's lr_scheduler_callable, from configure_from_prepare
        self._from_prepare = False

    precision = deepspeed_translating(_FabricDeepSpeedStrategy.precision, FabricDeepSpeedPrecision)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Lightning's loading, weights-only (:func:`check_deepspeed_folder`).

        Raises:
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
            ValueError: If the ``latest`` tag of the folder is outside it.

        """
        check_deepspeed_folder(path, weights_only)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    def configure_from_prepare(
        self,
        batch_sizes: Sequence[int | None],
        *,
        split_batches: bool,
        torch_optimizer: bool,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        """Fill the config's "auto" entries by Accelerate's rules, for the engine ``Accelerator.prepare`` builds.

        ``lightning_accel.Accelerator`` calls it before it sets up a model (see
        :mod:`~lightning_accel.strategies.deepspeed_prepare`).

        Args:
            batch_sizes: Batch sizes of the data loaders in the same call (``None`` where unknown).
            split_batches: Whether those batches are split over the processes.
            torch_optimizer: Whether the call holds a torch optimizer.
            optimizer: The call's optimizer (torch or ``DummyOptim``), if any.
            scheduler: The call's scheduler (torch or ``DummyScheduler``), if any.

        Raises:
            ValueError: If the optimizer or scheduler does not match the config's sections (as in Accelerate).

        """
        plugin = self._family.plugin
        check_dummies(plugin.deepspeed_config, optimizer, scheduler)
        self._scheduler_callable = getattr(scheduler, "lr_scheduler_callable", None)
        self._from_prepare = True
        fills = dummy_fills(optimizer, scheduler, self.world_size, split_batches)
        facts = PrepareFacts(
            world_size=self.world_size,
            device_type=self.root_device.type,
            accumulation=self._accumulation or 1,
            precision=facts_precision(self.precision),
            batch_sizes=tuple(batch_sizes),
            split_batches=split_batches,
            torch_optimizer=torch_optimizer,
            dummy_fills=tuple(fills.items()),
        )
        self._family.config = resolve_prepare_config(
            plugin.deepspeed_config, facts, is_train_batch_min=plugin.is_train_batch_min
        )
        self.config = self._family.config

    def step_engine(self) -> StepEngine | None:
        """The DeepSpeed engine (``None`` before the model is set up)."""
        return get_deepspeed_engine(self)

    @contextmanager
    def step_boundary(self, sync_gradients: bool) -> Generator[None, None, None]:
        """Tell the engine whether the backward pass in the body ends an accumulation (``sync_gradients``).

        The engine counts its own micro-steps only inside ``step()``, which runs at sync steps alone; a loop that
        accumulates without ``no_backward_sync`` (``transformers.Trainer``) would otherwise reach the engine's boundary
        every ``gradient_accumulation_steps`` optimizer steps instead of every step. The boundary is set back to the
        default (reached) afterwards.
        """
        engine = self.step_engine()
        if engine is None:
            yield
            return
        engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(is_boundary=True)

    def returned_model(self, wrapper: Module) -> Module:
        """The engine inside Fabric's ``wrapper``, as Accelerate's ``prepare`` returns it."""
        return fabric_forward_module(wrapper)

    def checkpoint_engine(self) -> EngineCheckpoint | None:
        """DeepSpeed writes ``save_state``'s models and optimizers itself (its tagged checkpoint folders)."""
        return DeepSpeedCheckpoint()

    @override
    def _setup_distributed(self) -> None:
        # Lightning's device-index check ran in setup_environment (for CUDA only: CPU devices have no index).
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not get_config_initialized(self):
            self._format_config()
            set_config_initialized(self, True)

    @override
    def _format_config(self) -> None:
        facts = TrainingFacts(
            world_size=self.world_size,
            device_type=self.root_device.type,
            precision=facts_precision(self.precision),
            accumulation=self._accumulation,
        )
        self.config = self._family.resolve(facts)

    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any = None
    ) -> tuple[Any, Any, Any]:
        # A config with an "optimizer" section builds its own: the torch optimizer only names the parameters.
        declared_optimizer = "optimizer" in self._family.config
        dummy = optimizer if isinstance(optimizer, DummyOptim) else None
        # A DummyOptim's values were filled by configure_from_prepare (if "auto").
        self.config = self._family.engine_config(model, None if dummy else optimizer, None)
        given = scheduler
        if dummy is not None and scheduler is None:
            scheduler = self._scheduler_callable  # Accelerate gives it only with a DummyOptim
        engine, ds_optimizer, ds_scheduler = self._family.initialize(
            model,
            None if declared_optimizer else optimizer,
            self.local_rank,
            self.config,
            lr_scheduler=scheduler,
            model_parameters=None if dummy is None else dummy.params,
        )
        # Fabric's setup returns a scheduler the engine built from the config; under prepare it stays the engine's
        # (``engine.lr_scheduler``, returned for a DummyScheduler) and setup returns only one it was given.
        keep = given is not None or not self._from_prepare
        return engine, ds_optimizer, ds_scheduler if keep else None

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        if not get_config_initialized(self):
            raise RuntimeError(
                "The DeepSpeed config is decided when the processes start: call `fabric.launch()` before"
                " `fabric.init_module()`."
            )
        return self._family.sharded_init_context(self.remote_device)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Write DeepSpeed's checkpoint folder (and the full weights where the plugin asks for them).

        Raises:
            ValueError: If the checkpoint I/O saves in the background, which DeepSpeed's engine does not use.

        """
        refuse_async_checkpoint_io(self.checkpoint_io, "acc_deepspeed's checkpoint folder", _DEEPSPEED_ASYNC_FIX)
        path = self.broadcast(path)
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        self._family.save_full_weights(self.model, path)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register nothing: the ``acc_deepspeed*`` names come from lightning_accel's table."""


_DEEPSPEED_ASYNC_FIX = (
    "Drop the asynchronous CheckpointIO from the plugins (acc_deepspeed saves synchronously), or save in the"
    " background with acc_ddp or acc_fsdp. DeepSpeed's own background writer (the config's"
    " checkpoint.writer.decoupled) needs its async_io op, built against libaio (`apt install libaio-dev`)."
)


def _loop_accumulation(config: Mapping[str, Any], steps: int | None) -> int | None:
    """The loop's accumulation, checked against the config's own value (``"auto"`` takes the loop's).

    Raises:
        ValueError: If both are set and differ.

    """
    configured = config.get("gradient_accumulation_steps", "auto")
    if steps is None or configured in ("auto", None) or configured == steps:
        return steps
    raise ValueError(
        f"The DeepSpeed config has gradient_accumulation_steps={configured!r}, but the training loop accumulates"
        f" {steps} micro-batches per step (Accelerator(gradient_accumulation_steps=...)). Set the same value in both,"
        " or 'auto' in the DeepSpeed config (DeepSpeedPlugin(gradient_accumulation_steps='auto'))."
    )


def _batch_sizes(loaders: Any) -> list[int]:
    """The integer batch sizes of every DataLoader in a (nested) collection or ``CombinedLoader``."""
    if isinstance(loaders, DataLoader):
        size = getattr(loaders.batch_sampler, "batch_size", None) or loaders.batch_size
        return [size] if isinstance(size, int) else []
    if hasattr(loaders, "flattened"):
        return _batch_sizes(loaders.flattened)
    if isinstance(loaders, Mapping):
        return [s for v in loaders.values() for s in _batch_sizes(v)]
    if isinstance(loaders, (list, tuple)):
        return [s for v in loaders for s in _batch_sizes(v)]
    return []


_OFFLOAD_TO_CPU = {"offload_optimizer_device": "cpu", "offload_param_device": "cpu"}


def _entry(
    name: str, description: str, dt: DistributedType | None = None, fields: Mapping[str, Any] | None = None
) -> StrategyEntry:
    params = {"plugin_fields": dict(fields)} if fields else {}
    return StrategyEntry(
        name, AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy, description, dt, params
    )


ENTRIES: tuple[StrategyEntry, ...] = (
    _entry("acc_deepspeed", "DeepSpeed ZeRO on CPU or CUDA, set by deepspeed_plugin", DistributedType.DEEPSPEED),
    _entry("acc_deepspeed_stage_1", "DeepSpeed ZeRO stage 1 (optimizer state sharded)", None, {"zero_stage": 1}),
    _entry(
        "acc_deepspeed_stage_2",
        "DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded)",
        None,
        {"zero_stage": 2},
    ),
    _entry("acc_deepspeed_stage_3", "DeepSpeed ZeRO stage 3 (parameters sharded too)", None, {"zero_stage": 3}),
    _entry(
        "acc_deepspeed_stage_3_offload",
        "DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to CPU",
        None,
        {"zero_stage": 3, **_OFFLOAD_TO_CPU},
    ),
)
