"""``Accelerator``: Hugging Face Accelerate's training-loop API, run by a Lightning ``Fabric``.

A script written for ``accelerate.Accelerator`` runs here after changing its imports. The class is an adapter: the
strategy (chosen by :func:`~lightning_accel.strategies.strategy_for`) wraps models and owns the process group and
gradient synchronisation, the precision plugin owns autocast and loss scaling, :mod:`lightning_accel.state` holds the
shared state, :mod:`lightning_accel.data_loader` the data loaders and :mod:`lightning_accel.checkpointing` the
checkpoints.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_accel._accelerator import engine_step as _engine_step
from lightning_accel._accelerator import fabric as _fabric
from lightning_accel._accelerator import lomo as _lomo
from lightning_accel._accelerator import module as _module
from lightning_accel._accelerator import parallelism as _parallelism
from lightning_accel._accelerator.checkpoints import Checkpoints
from lightning_accel._accelerator.checks import (
    check_arguments,
    check_type,
    named_trackers,
    parallelism_from_tp_plugin,
    refuse_unsupported,
    with_split_batches,
)
from lightning_accel._accelerator.data_loaders import DataLoaders
from lightning_accel._accelerator.deepspeed_members import ReturnedModels, ulysses_loader
from lightning_accel._accelerator.gradients import GradientClipping, raw_optimizer
from lightning_accel._accelerator.megatron import PipelineEngine
from lightning_accel._accelerator.module import (
    AcceleratedModule,
    autocast_own_forward,
    check_quantized_placement,
    distributed_data_parallel,
    evaluation_module,
    plain_optimizer_step,
)
from lightning_accel._accelerator.parallelism import Parallelism
from lightning_accel._accelerator.precision import KwargsHandlers, MixedPrecision, check_fp8_handlers
from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel._accelerator.process import Trigger, main_only
from lightning_accel._accelerator.profiling import profiled
from lightning_accel.checkpoint.manifest import ChecksumName
from lightning_accel.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    MegatronLMPlugin,
    ParallelismConfig,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lightning_accel.config.devices import BACKEND_BY_TYPE
from lightning_accel.config.fp8 import AORecipeKwargs, FP8RecipeKwargs, TERecipeKwargs
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.data_loader import DataLoaderShard, check_rng_types
from lightning_accel.data_loader import skip_first_batches as _skip_first_batches
from lightning_accel.enums import DistributedType, DynamoBackend, FP8BackendType
from lightning_accel.launch_settings import accelerator_kwargs, settings_from_env
from lightning_accel.lightning_compat import get_backward_sync_control
from lightning_accel.optimizer import AcceleratedOptimizer, DeepSpeedOptimizerWrapper
from lightning_accel.scheduler import AcceleratedScheduler, MegatronLMSchedulerWrapper
from lightning_accel.state import AcceleratorState, GradientState
from lightning_accel.strategies.protocol import ShimStrategy, as_shim_strategy
from lightning_accel.tracking import GeneralTracker, resolve_trackers
from lightning_accel.tracking.registry import check_logging_dir
from lightning_accel.tracking.trackers import Trackers
from lightning_accel.utils import modeling, operations
from lightning_accel.utils.deepspeed import DeepSpeedEngineWrapper
from lightning_accel.utils.imports import is_bitsandbytes_multi_backend_available, is_xpu_available
from lightning_accel.utils.other import extract_model_from_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["Accelerator"]


class Accelerator:
    """Accelerate's ``Accelerator`` on Lightning Fabric and lightning_accel's strategies and precision plugins.

    A facade: each topic's work is done by a collaborator built once here (``Checkpoints``, ``DataLoaders``,
    ``MixedPrecision``, ``Parallelism``, ``Trigger``, ``Trackers``, ``GradientClipping``), which receives what it
    reads as constructor arguments; the prepared objects live in one ``PreparedObjects``.

    Arguments left at their defaults are read from the launch environment (``ACCELERATE_MIXED_PRECISION``,
    ``ACCELERATE_USE_CPU``, ``ACCELERATE_USE_FSDP`` with ``FSDP_*``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ...)
    through :mod:`lightning_accel.utils.environment`. Several processes are detected from torchrun, SLURM or
    ``WORLD_SIZE``/``LOCAL_RANK``.

    Args:
        device_placement: Move prepared models and batches to :attr:`device`.
        mixed_precision: ``"no"``, ``"fp16"`` (GPU only), ``"bf16"`` or ``"fp8"``.
        gradient_accumulation_steps: Micro-batches per optimizer step (or pass ``gradient_accumulation_plugin``).
        cpu: Train on CPU even when an accelerator is present.
        dataloader_config: How data loaders are prepared (seedable sampler, ``even_batches``, ...).
        deepspeed_plugin: Train with DeepSpeed.
        fsdp_plugin: Train with FSDP.
        rng_types: Generators synchronised from process 0 at each epoch: ``"generator"`` (the sampler's) and/or
            ``"torch"``. Default ``["generator"]``.
        project_dir: Root of checkpoints (``<project_dir>/checkpoints``) and logs.
        project_config: Checkpoint naming and rotation.
        gradient_accumulation_plugin: Full accumulation settings (exclusive with ``gradient_accumulation_steps``).
        step_scheduler_with_optimizer: Step prepared schedulers by Accelerate's rules (see ``AcceleratedScheduler``).
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``InitProcessGroupKwargs``, ``AutocastKwargs``,
            ``GradScalerKwargs``, fp8 recipes (``AORecipeKwargs``, ``TERecipeKwargs``, ``FP8RecipeKwargs``),
            ``ProfileKwargs``; each goes to the strategy, precision plugin or method that uses it.
        dynamo_plugin: ``torch.compile`` settings applied by the strategy when a model is prepared.
        log_with: Tracker names (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"comet_ml"``, ``"all"``) or objects.
        megatron_lm_plugin: Megatron-LM settings: the run uses ``acc_megatron_lm`` (tensor, pipeline and data
            parallelism; at ``pp_degree > 1`` the prepared model's forward is the whole training step, as in
            Accelerate).
        dynamo_backend: Shorthand for ``dynamo_plugin=TorchDynamoPlugin(backend=...)``.
        split_batches: Deprecated in Accelerate: ``DataLoaderConfiguration(split_batches=...)``. Given here, it is
            applied to the data-loader configuration with a ``FutureWarning`` (Accelerate 1.15 ignores it).
        parallelism_config: N-D parallelism (``dp_replicate x dp_shard x cp x tp`` on a device mesh) through the
            ``acc_parallel`` strategy, with ``fsdp_plugin`` for the shard dimensions. A model is split over ``tp`` by
            the plan it carries (``model.tp_plan``) or by ``parallelize_module`` on ``torch_device_mesh["tp"]``
            before ``prepare``.
        torch_tp_plugin: Accelerate's deprecated tensor-parallel plugin: ``ParallelismConfig(tp_size=its tp_size)``.
        deepspeed_plugins: Several named DeepSpeed configurations; not supported yet (``NotImplementedError``).

    Raises:
        TypeError: For arguments of the wrong type.
        ValueError: For invalid combinations (both accumulation arguments, two plugins, fp16 on CPU, ...).

    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: MegatronLMPlugin | None = None,
        rng_types: Sequence[Any] | None = None,
        log_with: str | GeneralTracker | Sequence[str | GeneralTracker] | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: ParallelismConfig | None = None,
    ) -> None:
        refuse_unsupported(deepspeed_plugins=deepspeed_plugins)
        parallelism_config = parallelism_from_tp_plugin(torch_tp_plugin, parallelism_config)
        dataloader_config = with_split_batches(dataloader_config, split_batches)
        check_arguments(
            dataloader_config=dataloader_config,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            dynamo_plugin=dynamo_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            parallelism_config=parallelism_config,
        )
        if dynamo_backend is not None:
            if dynamo_plugin is not None:
                raise ValueError("Pass dynamo_backend or dynamo_plugin, not both: set TorchDynamoPlugin(backend=...).")
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)  # type: ignore[arg-type]  # validated there
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps != 1:
            raise ValueError(
                "Pass gradient_accumulation_steps or gradient_accumulation_plugin, not both: set"
                " GradientAccumulationPlugin(num_steps=...) instead."
            )
        # Everything that can be checked without processes is checked before the strategy starts them.
        handlers = _fabric.split_handlers(kwargs_handlers)
        self._handlers = KwargsHandlers.of(kwargs_handlers)
        self.rng_types = check_rng_types(["generator"] if rng_types is None else rng_types)
        self.device_placement = device_placement
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        check_logging_dir(named_trackers(log_with), self.logging_dir)  # at construction, as Accelerate checks
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        settings = accelerator_kwargs(
            {
                "mixed_precision": mixed_precision,
                "cpu": cpu or None,
                "gradient_accumulation_steps": None
                if gradient_accumulation_steps == 1
                else gradient_accumulation_steps,
                "fsdp_plugin": fsdp_plugin,
                "deepspeed_plugin": deepspeed_plugin,
                "dynamo_plugin": dynamo_plugin,
                "megatron_lm_plugin": megatron_lm_plugin,
                "parallelism_config": parallelism_config,
            }
        )
        self._dynamo_plugin = settings.get("dynamo_plugin")
        self.gradient_state = GradientState(
            gradient_accumulation_plugin
            or GradientAccumulationPlugin(num_steps=settings.get("gradient_accumulation_steps", 1))
        )
        self.fabric = self._launch(settings, handlers)
        self.step = 0
        self._build_collaborators(dataloader_config, resolve_trackers(log_with))

    def _build_collaborators(
        self, dataloader_config: DataLoaderConfiguration, log_with: list[str | GeneralTracker]
    ) -> None:
        """Build the collaborators each topic's members delegate to (once the Fabric and its strategy exist)."""
        fabric, strategy, state = self.fabric, self._strategy, self.state
        self._prepared = prepared = PreparedObjects()
        self._trigger = Trigger(state=state)
        self._trackers = Trackers(log_with=log_with, project=self.project_configuration)
        self._loaders = DataLoaders(config=dataloader_config, strategy=strategy, state=state, prepared=prepared)
        self._mixed_precision = MixedPrecision(fabric=fabric, strategy=strategy, state=state, handlers=self._handlers)
        self._parallelism = Parallelism(state=state, strategy=strategy)
        init = self._handlers.init_handler
        self._checkpoints = Checkpoints(
            fabric=fabric,
            strategy=strategy,
            state=state,
            prepared=prepared,
            project=self.project_configuration,
            precision=self._mixed_precision,
            timeout=init.timeout if init is not None else None,
        )
        self._gradients = GradientClipping(fabric=fabric, strategy=strategy, prepared=prepared)
        self._returned = ReturnedModels(strategy=strategy, prepared=prepared)

    def _launch(self, settings: dict[str, Any], handlers: dict[str, KwargsHandler]) -> Fabric:
        """Pick the distributed type, build and launch the Fabric, and record the processes in the shared state."""
        launch = _fabric.detect_launch()
        device = _fabric.device_type(bool(settings["cpu"]))
        plugin_names = ("fsdp_plugin", "deepspeed_plugin", "megatron_lm_plugin", "dynamo_plugin", "parallelism_config")
        plugins = {name: settings.get(name) for name in plugin_names}
        dtype = _fabric.distributed_type(launch, device, plugins)
        mixed_precision = str(settings["mixed_precision"])
        check_fp8_handlers(self._handlers, mixed_precision, dtype)
        fabric = _fabric.build_fabric(
            dtype, device, launch, mixed_precision=mixed_precision, handlers=handlers, plugins=plugins
        )
        self._strategy: ShimStrategy = as_shim_strategy(fabric.strategy)
        self.state = AcceleratorState(cpu=bool(settings["cpu"]))
        self.state._configure(
            self._strategy.distributed_type or dtype,
            _fabric.recorded_device(fabric, bool(settings["cpu"])),
            num_processes=fabric.world_size,
            process_index=fabric.global_rank,
            local_index=fabric.local_rank,
            debug=bool(settings_from_env().get("debug", False)),
        )
        self.state.mixed_precision = mixed_precision
        self.state._record_plugins(**_parallelism.recorded_plugins(self._strategy, plugins))
        return fabric

    # ---- configuration ------------------------------------------------------------------------------------------

    @property
    def project_dir(self) -> str | None:
        """Root of automatically named checkpoints."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Directory of file-based trackers."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Index of the next automatically named checkpoint."""
        return self.project_configuration.iteration

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """How data loaders are prepared (seedable sampler, ``even_batches``, ...)."""
        return self._loaders.config

    @property
    def split_batches(self) -> bool:
        """``dataloader_config.split_batches``: each batch is split between the processes."""
        return self._loaders.config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """``dataloader_config.dispatch_batches``: process 0 reads the batches and sends them out."""
        return self._loaders.config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """``dataloader_config.even_batches``: the last round is padded so every process gets as many batches."""
        return self._loaders.config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """Change ``even_batches`` for the loaders prepared from now on."""
        self._loaders.config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """``dataloader_config.use_seedable_sampler``."""
        return self._loaders.config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """``dataloader_config.non_blocking``: batches are copied to the device asynchronously."""
        return self._loaders.config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """``dataloader_config.use_stateful_dataloader``: loaders are torchdata ``StatefulDataLoader`` s."""
        return self._loaders.config.use_stateful_dataloader

    # ---- kwargs handlers (Accelerate's attribute per handler, ``None`` where not given) ---------------------------

    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        """The ``DistributedDataParallelKwargs`` among ``kwargs_handlers``."""
        return self._handlers.ddp_handler

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        """The ``GradScalerKwargs`` among ``kwargs_handlers``."""
        return self._handlers.scaler_handler

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        """The ``InitProcessGroupKwargs`` among ``kwargs_handlers``."""
        return self._handlers.init_handler

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        """The ``AutocastKwargs`` among ``kwargs_handlers``."""
        return self._handlers.autocast_handler

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The ``ProfileKwargs`` among ``kwargs_handlers``."""
        return self._handlers.profile_handler

    @property
    def fp8_recipe_handler(self) -> FP8RecipeKwargs | None:
        """The ``FP8RecipeKwargs`` among ``kwargs_handlers``."""
        return self._handlers.fp8_recipe_handler

    @property
    def ao_recipe_handler(self) -> AORecipeKwargs | None:
        """The ``AORecipeKwargs`` among ``kwargs_handlers``."""
        return self._handlers.ao_recipe_handler

    @property
    def te_recipe_handler(self) -> TERecipeKwargs | None:
        """The ``TERecipeKwargs`` among ``kwargs_handlers``."""
        return self._handlers.te_recipe_handler

    @property
    def msamp_recipe_handler(self) -> None:
        """Always ``None``: lightning_accel has no MS-AMP backend."""
        return self._handlers.msamp_recipe_handler

    # ---- processes -----------------------------------------------------------------------------------------------

    @property
    def distributed_type(self) -> DistributedType:
        """The Accelerate type of the strategy in use."""
        return self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``."""
        return str(self.state.mixed_precision)

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self.state.device

    @property
    def num_processes(self) -> int:
        """Processes in the run."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """The global rank of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """The rank of this process on its node."""
        return self.state.local_process_index

    @property
    def use_distributed(self) -> bool:
        """Whether several processes take part."""
        return self.state.use_distributed

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 of its node."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the highest global rank."""
        return self.state.is_last_process

    def wait_for_everyone(self) -> None:
        """Block until every process gets here."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per node."""
        self.state.print(*args, **kwargs)

    def main_process_first(self) -> AbstractContextManager[None]:
        """Run the body on the main process first, then on the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> AbstractContextManager[None]:
        """Run the body on each node's main process first."""
        return self.state.local_main_process_first()

    def on_main_process(self, function: _F | None = None) -> Any:
        """Decorate ``function`` to run on the global main process only (elsewhere it returns ``None``).

        As in Accelerate it also decorates methods of an ``Accelerator`` subclass when used on the class
        (``@Accelerator.on_main_process``), where the method itself arrives as ``self``.

        Raises:
            ValueError: When called on an ``Accelerator`` without a function.

        """
        return main_only(self, function, "on_main_process")

    def on_local_main_process(self, function: _F | None = None) -> Any:
        """Decorate ``function`` to run on each node's main process only (see :meth:`on_main_process`)."""
        return main_only(self, function, "on_local_main_process")

    def on_last_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: _F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on global rank ``process_index`` only."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: _F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on local rank ``local_process_index`` of every node only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> AbstractContextManager[Any]:
        """Give this process its share of ``inputs`` as the context's value (see ``PartialState``)."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    @property
    def flag_tensor(self) -> torch.Tensor | None:
        """The flag :meth:`set_trigger` raised on this process, ``None`` while it is down."""
        return self._trigger.flag_tensor

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` returns ``True`` on every process."""
        self._trigger.set()

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (collective; resets the flags)."""
        return self._trigger.check()

    # ---- precision -----------------------------------------------------------------------------------------------

    @property
    def has_fp8_handler(self) -> bool:
        """Whether an fp8 recipe was given, or (with ``mixed_precision='fp8'``) the precision plugin chose one."""
        return self._mixed_precision.has_fp8_handler

    @property
    def fp8_enabled(self) -> bool:
        """Whether the run trains in fp8 (``mixed_precision='fp8'``)."""
        return self._mixed_precision.fp8_enabled

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The fp8 library: the recipe's, else the precision plugin's, else ``ACCELERATE_FP8_BACKEND`` (``NO``)."""
        return self._mixed_precision.fp8_backend

    @property
    def delayed_fp8_autocast(self) -> bool:
        """Whether Transformer Engine's fp8 autocast wraps the model after the strategy's wrapper (DDP, FSDP)."""
        return self._mixed_precision.delayed_fp8_autocast

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler of the precision plugin (``None`` without fp16, on CPU and under DeepSpeed)."""
        return self._mixed_precision.scaler

    @property
    def native_amp(self) -> bool:
        """Whether ``torch.autocast`` runs the forward (fp16/bf16/fp8 mixed precision outside DeepSpeed)."""
        return self._mixed_precision.native_amp

    # ---- parallelism ---------------------------------------------------------------------------------------------

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The ``ParallelismConfig`` in use (with the sizes the processes fill in), ``None`` without one."""
        return self._parallelism.parallelism_config

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The device mesh (Accelerate's dimension names), ``None`` without a ``parallelism_config``."""
        return self.state.__dict__.get("device_mesh")

    @property
    def is_fsdp2(self) -> bool:
        """Whether the model is sharded with FSDP2."""
        return self.state.is_fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether parallelisms compose on a mesh (FSDP2), as Accelerate answers."""
        return self.state.is_fsdp2

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model.

        With a ``parallelism_config`` every process does (Accelerate's answer), else the local main processes.
        """
        return self.parallelism_config is not None or self.state.is_local_main_process

    @property
    def multi_device(self) -> bool:
        """Whether several processes train data parallel on accelerators (``MULTI_GPU``, ``MULTI_XPU``, ...)."""
        backend = BACKEND_BY_TYPE.get(self.state.distributed_type)
        device = backend.device_type if backend is not None else None
        return self.state.use_distributed and device not in (None, "cpu", "xla")

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The active ``DeepSpeedPlugin``, ``None`` without DeepSpeed."""
        return self.state.deepspeed_plugin

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The active DeepSpeed plugin's config (what the engine is built from).

        Raises:
            AttributeError: Outside a DeepSpeed run (Accelerate has no such attribute there either).

        """
        plugin = self.deepspeed_plugin
        if plugin is None:
            raise AttributeError(
                "deepspeed_config exists only in DeepSpeed runs: pass"
                " Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))."
            )
        return plugin.deepspeed_config

    @property
    def tensor_parallel_rank(self) -> int:
        """The coordinate of this process along ``tp`` (0 when ``tp_size == 1``).

        Raises:
            RuntimeError: Without a ``parallelism_config``.

        """
        return self._parallelism.mesh_rank("tp", "tp_enabled", "Tensor parallelism")

    @property
    def data_parallel_rank(self) -> int:
        """The coordinate of this process along ``dp_replicate`` (0 without replication).

        Raises:
            RuntimeError: Without a ``parallelism_config``.

        """
        return self._parallelism.mesh_rank("dp_replicate", "dp_replicate_enabled", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """The coordinate of this process along ``dp_shard`` (0 without sharding).

        Raises:
            RuntimeError: Without a ``parallelism_config``.

        """
        return self._parallelism.mesh_rank("dp_shard", "dp_shard_enabled", "Shard-based data parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """Not available, as in Accelerate 1.15.

        Raises:
            NotImplementedError: Always.

        """
        raise NotImplementedError("Context parallelism is currently not supported in Accelerate.")

    @property
    def pipeline_parallel_rank(self) -> int:
        """Not available, as in Accelerate 1.15.

        Raises:
            NotImplementedError: Always.

        """
        raise NotImplementedError("Pipeline parallelism is currently not supported in Accelerate.")

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> AbstractContextManager[None]:
        """Shard ``buffers`` along their sequence dimensions over ``cp`` inside the block (``cp_size > 1``).

        Without context parallelism the block runs unchanged, with a warning (once), as in Accelerate.
        """
        return self._parallelism.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

    # ---- the prepared objects, read-only under Accelerate's names (its tests and transformers read them) ----------

    @property
    def _models(self) -> list[AcceleratedModule]:
        return self._prepared.models

    @property
    def _optimizers(self) -> list[AcceleratedOptimizer]:
        return self._prepared.optimizers

    @property
    def _schedulers(self) -> list[AcceleratedScheduler]:
        return self._prepared.schedulers

    @property
    def _dataloaders(self) -> list[DataLoaderShard]:
        return self._prepared.dataloaders

    @property
    def _custom_objects(self) -> list[Any]:
        return self._prepared.custom_objects

    # ---- prepare -------------------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Sequence[bool] | None = None) -> Any:
        """Prepare models, optimizers, data loaders and schedulers (in any order) and return them in the same order.

        Models and their optimizers are set up together by the strategy; schedulers are wrapped after, bound to the
        prepared optimizers they drive. Other objects are returned unchanged.

        Raises:
            ValueError: If ``device_placement`` does not have one entry per argument.
            AttributeError: If ``AcceleratorState._reset_state()`` was called since this accelerator was created.

        """
        _ = self.state.mixed_precision  # the reset state's AttributeError names the reset, as Accelerate's does
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects.")
        placement = list(device_placement) if device_placement is not None else [self.device_placement] * len(args)
        result = list(args)
        self._prepare_models_and_optimizers(result, placement)
        for i, obj in enumerate(result):
            if isinstance(obj, DataLoader) and not isinstance(obj, DataLoaderShard):
                result[i] = self.prepare_data_loader(obj, device_placement=placement[i])
        for i, obj in enumerate(result):
            if isinstance(obj, _engine_step.SCHEDULERS) and not getattr(obj, "_is_accelerate_prepared", False):
                result[i] = self.prepare_scheduler(obj)
        for before, after in zip(args, result, strict=True):
            if after is not before:
                after._is_accelerate_prepared = True  # Accelerate's mark: prepare returns such objects unchanged
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_models_and_optimizers(self, objects: list[Any], placement: list[bool]) -> None:
        _module.reuse_prepared(objects, self._prepared.models)  # a module prepared before gets the wrapper it got then
        models = [i for i, obj in enumerate(objects) if isinstance(obj, Module) and not self._returned.is_prepared(obj)]
        optimizers = [i for i, obj in enumerate(objects) if _is_raw_optimizer(obj)]
        for i in models:
            facts = {"cpu_kernels": is_bitsandbytes_multi_backend_available(), "xpu": is_xpu_available()}
            check_quantized_placement(objects[i], distributed=self.state.distributed_type != "NO", **facts)
        if models:  # an engine (DeepSpeed) fills its config from the whole call, as Accelerate's prepare does
            _fabric.describe_prepare_call(self._strategy, objects, self.split_batches)
        for i in models:  # a model that carries a tensor-parallel plan is split before the strategy shards it
            _parallelism.apply_model_tp_plan(objects[i], [objects[j] for j in optimizers], self.torch_device_mesh)
        # One model with its optimizers: the strategy sets them up together (DeepSpeed needs it).
        if len(models) == 1 and optimizers:
            move = placement[models[0]]
            model, *opts = self.fabric.setup(objects[models[0]], *(objects[i] for i in optimizers), move_to_device=move)
            self._register_model(objects, models[0], model)
            for i, opt in zip(optimizers, opts, strict=True):
                objects[i] = self._register_optimizer(opt, placement[i])
            return
        for i in models:
            self._register_model(objects, i, self.fabric.setup_module(objects[i], move_to_device=placement[i]))
        for i in optimizers:
            optimizer = cast(Optimizer, self.fabric.setup_optimizers(objects[i]))
            objects[i] = self._register_optimizer(optimizer, placement[i])

    def _register_model(self, objects: list[Any], index: int, model: _FabricModule) -> None:
        adopted = AcceleratedModule.adopt(model)
        self._autocast_own_forward(adopted)
        self._prepared.models.append(adopted)
        objects[index] = self._returned.returned(adopted)

    def _autocast_own_forward(self, prepared: Module) -> None:
        """As Accelerate: the user's module computes in the mixed dtype when called unwrapped, too."""
        precision = self._mixed_precision.autocasting_plugin()
        if precision is not None:
            autocast_own_forward(extract_model_from_parallel(prepared), precision)

    def _register_optimizer(self, optimizer: Optimizer, device_placement: bool) -> AcceleratedOptimizer:
        strategy = self.fabric.strategy
        engine, plain = self._strategy.engine_steps_in_backward, plain_optimizer_step(strategy)
        place = device_placement and not engine  # an engine (DeepSpeed) places its own optimizer state
        in_forward = self._strategy.pipeline() is not None  # the prepared model's forward steps it
        wrapped = (
            DeepSpeedOptimizerWrapper(optimizer, precision=strategy.precision)
            if engine
            else AcceleratedOptimizer(
                optimizer, place, precision=strategy.precision, plain_step=plain, engine_steps=in_forward
            )
        )
        self._prepared.optimizers.append(wrapped)
        return wrapped

    def prepare_model(
        self, model: Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Module:
        """Set up one model with the strategy (wrap, move, compile).

        With ``evaluation_mode`` the model is for inference only, as in Accelerate: moved, compiled and run under the
        precision plugin, but not wrapped for distributed training.
        """
        if not evaluation_mode:
            return self.prepare(model, device_placement=None if device_placement is None else [device_placement])
        place = self.device_placement if device_placement is None else device_placement
        prepared = evaluation_module(model, self.fabric.strategy, self.device if place else None, self._dynamo_plugin)
        self._autocast_own_forward(prepared)
        self._prepared.models.append(prepared)
        return prepared

    def verify_device_map(self, model: Module) -> bool:
        """Whether ``model`` was dispatched over several devices with a device map (such a model is not trained)."""
        return modeling.verify_device_map(model)

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Set up one optimizer (after its model); ``device_placement`` moves its state to :attr:`device`."""
        return self.prepare(optimizer, device_placement=None if device_placement is None else [device_placement])

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps with its prepared optimizer (a ``DummyScheduler``: the engine's)."""
        optimizers = [opt for opt in self._prepared.optimizers if raw_optimizer(opt) is scheduler.optimizer]
        if self._strategy.pipeline() is not None:  # the prepared model's training step steps it
            wrapped: AcceleratedScheduler = MegatronLMSchedulerWrapper(scheduler, optimizers)
        else:
            wrapped = _engine_step.engine_scheduler(self._strategy, scheduler, self._prepared.optimizers) or (
                AcceleratedScheduler(scheduler, optimizers, self.step_scheduler_with_optimizer, self.split_batches)
            )
        self._prepared.schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable[..., Any] | None = None,
    ) -> DataLoaderShard:
        """Shard ``data_loader`` for this process as :attr:`dataloader_config` says.

        See :func:`lightning_accel.data_loader.prepare_data_loader`; ``slice_fn_for_dispatch`` slices dispatched
        batches (``dispatch_batches``). A loader prepared already is returned as it is.
        """
        place = self.device_placement if device_placement is None else device_placement
        return self._loaders.prepare(
            data_loader, device_placement=place, rng_types=self.rng_types, slice_fn_for_dispatch=slice_fn_for_dispatch
        )

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        """A copy of a prepared loader that skips its first ``num_batches`` batches."""
        return _skip_first_batches(dataloader, num_batches)

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> AbstractContextManager[None]:
        """Let processes with fewer batches drop out of gradient synchronisation instead of hanging (DDP only).

        Inside the block, torch's ``Join`` shadows the collectives of processes that ran out of batches. It is on
        when the loaders are uneven (``even_batches=False``); ``even_batches`` overrides the setting of the map-style
        loaders prepared so far for the duration of the block. Elsewhere than DDP it warns and has no effect.

        Args:
            joinables: Prepared models (and other ``torch.distributed.algorithms.Joinable`` objects).
            even_batches: Temporarily pad (``True``) or not (``False``) the prepared map-style loaders.

        Raises:
            TypeError: If an object cannot join (e.g. a plain optimizer), naming it.

        """
        return self._loaders.join_uneven_inputs(joinables, even_batches)

    # ---- the training step ---------------------------------------------------------------------------------------

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-step synchronises gradients and steps the optimizer."""
        return bool(self.gradient_state.sync_gradients)

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        """Change the micro-batches per optimizer step (not once a DeepSpeed engine, which fixes them, exists).

        Raises:
            ValueError: For a count below 1, or under DeepSpeed after ``prepare``.

        """
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {value!r}.")
        if self._prepared.models and self._strategy.engine_steps_in_backward:
            raise ValueError(
                "The DeepSpeed engine fixed its accumulation steps in prepare: set them before, in"
                " Accelerator(gradient_accumulation_steps=...) or the DeepSpeed config."
            )
        self.gradient_state.plugin_kwargs["num_steps"] = value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` divided by the accumulation steps, through the strategy and precision plugin.

        Engines that accumulate themselves (DeepSpeed) get it undivided and step here at sync steps, as in Accelerate.
        With a LOMO optimizer prepared, ``learning_rate=`` runs its fused backward (:meth:`lomo_backward`). Under a
        pipeline-parallel Megatron model it does nothing: the model's forward ran the step, as in Accelerate.
        """
        models = self._prepared.models
        if not models:
            _module.check_backward_after_prepare(models)
        if self._strategy.pipeline() is not None:
            return  # the prepared model's forward ran the backward passes (Megatron's pipeline, as in Accelerate)
        steps = self.gradient_state.num_steps
        if kwargs and kwargs.get("learning_rate") is not None and self.has_lomo_optimizer:
            self.lomo_backward(loss / steps, kwargs["learning_rate"])
            return
        if steps != 1 and not self._strategy.engine_steps_in_backward:
            loss = loss / steps
        for prepared in models:
            if prepared._backward_guard is not None:
                break
        else:  # no model's strategy or precision plugin would add anything around it
            loss.backward(**kwargs)
            return
        model = models[0] if len(models) == 1 else None
        with self._strategy.step_boundary(self.sync_gradients):
            self.fabric.backward(loss, model=model, **kwargs)
        _engine_step.step_after_backward(self._strategy, self._prepared.optimizers, self.sync_gradients)

    def _do_sync(self) -> bool:
        """Count the micro-step and decide whether it synchronises; returns (and records) the decision."""
        state = self.gradient_state
        if state.end_of_dataloader and state.sync_with_dataloader:  # the first is False on most micro-steps
            self.step = 0
            sync = True
        else:
            self.step += 1
            sync = self.step % state.num_steps == 0
        state.sync_gradients = sync
        return sync

    def accumulate(self, *models: Module) -> AbstractContextManager[None]:
        """One micro-step: decide whether it synchronises, and skip gradient sync on the ones that do not."""
        return _Accumulation(self, models)

    def _syncs_each_batch(self) -> bool:
        """``sync_each_batch`` on several processes, unless skipping the sync is also the engine's step signal."""
        marks_boundary = self._strategy.marks_step_boundary
        return self.use_distributed and self.gradient_state.sync_each_batch and not marks_boundary

    @contextmanager
    def no_sync(self, model: Module) -> Generator[None, None, None]:
        """Skip gradient synchronisation in the body (a no-op where the strategy has nothing to skip)."""
        if get_backward_sync_control(self.fabric.strategy) is None:
            yield
            return
        model = self._returned.wrapper_of(model)
        if not isinstance(model, _FabricModule):
            raise TypeError(f"no_sync needs a model returned by Accelerator.prepare, got {type(model).__name__}.")
        with self.fabric.no_backward_sync(model, enabled=True):
            yield

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model: Module) -> Generator[None, None, None]:
        """Synchronise gradients in the next backward pass of a DDP ``model`` whose forwards ran under :meth:`no_sync`.

        A no-op for models without a ``DistributedDataParallel`` wrapper (one process, FSDP, DeepSpeed), as in
        Accelerate.
        """
        ddp = distributed_data_parallel(model)
        if ddp is None:
            yield
            return
        previous = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])  # the forwards under no_sync did not arm the reducer
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = previous

    @property
    def deepspeed_engine_wrapped(self) -> DeepSpeedEngineWrapper | None:
        """The first prepared DeepSpeed engine in Accelerate's ``DeepSpeedEngineWrapper`` (``None`` without one)."""
        return self._returned.engine_wrapped

    @deepspeed_engine_wrapped.setter
    def deepspeed_engine_wrapped(self, value: DeepSpeedEngineWrapper | None) -> None:
        self._returned.engine_wrapped = value

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Module) -> Any:
        """Adapt a data loader prepared apart from the model to DeepSpeed's Ulysses sequence parallelism.

        With a sequence-parallel size of 1 (always, here: lightning_accel refuses ``sp_size`` > 1, see
        ``ParallelismConfig``) ``dl`` is returned as it is, as Accelerate does; ``transformers.Trainer`` calls it
        only when sequence parallelism is on.

        Raises:
            NotImplementedError: With a ``parallelism_config`` whose ``sp_size`` is above 1.

        """
        return ulysses_loader(dl, self.parallelism_config)

    @property
    def has_lomo_optimizer(self) -> bool:
        """Whether a prepared optimizer is a LOMO optimizer."""
        return _lomo.has_lomo_optimizer(self._prepared.optimizers)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backpropagate ``loss`` through every prepared LOMO optimizer, which updates the parameters on the way.

        Raises:
            ImportError: Without the ``lomo-optim`` package.
            ValueError: Without a learning rate, or when no prepared optimizer is a LOMO optimizer.

        """
        _lomo.lomo_backward(self._prepared.optimizers, loss, learning_rate)

    @contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Generator[torch.profiler.profile, None, None]:
        """Profile the body with ``torch.profiler``; yields the profiler (call ``prof.step()`` with a schedule).

        With ``output_trace_dir`` set, every process writes ``profile_<process_index>.json`` (a Chrome trace) there
        after the block, and the processes wait for each other.

        Args:
            profile_handler: The settings for this block; default the ``ProfileKwargs`` among ``kwargs_handlers``,
                else torch's defaults.

        Raises:
            TypeError: If ``profile_handler`` is not a ``ProfileKwargs``.

        """
        with profiled(profile_handler, self.profile_handler, self.state) as profiler:
            yield profiler

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | float | None:
        """Clip the gradient norm of ``parameters`` (unscaling fp16 gradients first); returns the total norm.

        The norm is taken over ``parameters`` in the order given, as Accelerate's is. Under DeepSpeed, as in
        Accelerate: the engine clipped in ``backward`` by its config (``max_norm`` is ignored); returns its last
        step's norm (a float; ``None`` before the first step).

        Raises:
            ValueError: If ``max_norm`` is negative (it would flip the gradients' sign).

        """
        return self._gradients.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient of ``parameters`` to ``[-clip_value, clip_value]`` (after unscaling; not DeepSpeed)."""
        self._gradients.clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer: AcceleratedOptimizer | None = None) -> None:
        """Divide fp16 gradients by the loss scale now (a no-op without a gradient scaler)."""
        self._gradients.unscale_gradients(optimizer)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """The precision plugin's autocast context (a no-op in full precision or with ``enabled=False``)."""
        check_type("autocast_handler", autocast_handler, AutocastKwargs)
        handler = autocast_handler or self.autocast_handler
        if handler is not None and not handler.enabled:
            return nullcontext()
        return self.fabric.autocast()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether an optimizer skipped its last step (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._prepared.optimizers)

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``.

        Raises:
            ValueError: Naming the objects that lack either method.

        """
        self._checkpoints.register_for_checkpointing(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in ``save_state`` before the weights are written.

        The hook may pop entries from ``weights`` (and ``models``) to save them its own way.
        """
        return self._checkpoints.register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in ``load_state`` before the weights are loaded (it may pop models)."""
        return self._checkpoints.register_load_state_pre_hook(hook)

    def get_state_dict(self, model: Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict (on every process, or on the main process only for sharded weights).

        Sharded weights are gathered to the main process's CPU, as Accelerate does under FSDP and DeepSpeed ZeRO-3;
        the other processes get ``{}`` (collective: every process calls it). ZeRO-3 needs
        ``DeepSpeedPlugin(zero3_save_16bit_model=True)``, as in Accelerate.

        With ``unwrap=False`` it is the strategy-wrapped module's own state dict (DDP keys keep ``module.``).

        Raises:
            ValueError: Under ZeRO-3 without ``zero3_save_16bit_model``.

        """
        return self._checkpoints.get_state_dict(model, unwrap)

    def save_model(
        self,
        model: Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's weights: ``model.safetensors``, or shards and an index past ``max_shard_size``.

        File names and the index are Accelerate's (Hugging Face's), so ``from_pretrained``-style loaders read them.
        The arguments are checked on every process before any collective, and an error while the main process
        writes is raised on every process (none is left waiting). Replicated weights (one device, DDP) may be saved
        from the main process alone, as in Accelerate; sharded ones (FSDP, DeepSpeed ZeRO-3) need every process.

        Raises:
            TypeError: For a ``model`` that is not a module, or a non-boolean ``safe_serialization``.
            ValueError: For a ``save_directory`` that is a file, or a ``max_shard_size`` that is not a positive size.

        """
        self._checkpoints.save_model(model, save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` once (per node with ``save_on_each_node``); see :func:`lightning_accel.utils.other.save`."""
        self._checkpoints.save(obj, f, safe_serialization)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool = False,
        checksum: ChecksumName | None = "crc32",
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, RNG states and registered objects with Accelerate's file names.

        Under FSDP and DeepSpeed the engine writes the models and optimizers (sharded or gathered, by the plugin);
        ``save_model_func_kwargs`` go to DeepSpeed's ``save_checkpoint``. Returns the checkpoint directory. See
        :func:`lightning_accel.checkpointing.save_state`.

        Where the state is replicated (one device, DDP), a save into ``output_dir`` is Accelerate's call from any
        subset of the processes: nothing waits for another process, so ``if accelerator.is_main_process:
        accelerator.save_state(dir)`` works; the main process (each node's with ``save_on_each_node``) writes the
        shared files, every calling process its random states. Where each process holds a shard (FSDP, DeepSpeed),
        or with automatic naming (Accelerate waits for every process there too), every process must call it; one that
        does not is named in an error within the process group's timeout, instead of a hang.

        Unlike Accelerate's, the save is atomic: files are written into ``.<name>.incomplete`` beside the folder,
        which gets its name once complete; old folders are rotated out only then. See
        :mod:`lightning_accel.checkpoint.folders`. With ``save_on_each_node`` on node-local disks and a sharded
        state, each node is first sent the files it lacks (other nodes' shards, the metadata written on the main
        process only), so every node's folder is a whole checkpoint; see :mod:`lightning_accel.checkpoint.node_copies`.
        A process that names another ``output_dir`` than the main process's gets its own random states and loader
        states there, as Accelerate has every process write them.

        With ``async_save=True`` (not in Accelerate) the call returns once the state is copied into host memory; a
        thread writes the files and the folder is published when they are complete (where every process saved
        together, by the next :meth:`wait_for_checkpoint`, which ``save_state``, ``load_state`` and ``end_training``
        call first). Training may go on meanwhile: the files hold the state at the call. An error in the background
        is raised by that next call; a save killed in the background is never loaded or rotated. Under FSDP (full and
        sharded state dicts) and DeepSpeed the engine's gathers and barriers run in the call, on every process, and
        the thread writes the same files (FSDP's sharded ``torch.distributed.checkpoint`` saves plan over a gloo group
        of their own); not under Megatron, nor with a DeepSpeed checkpoint writer other than ``torch.save``.

        The folder gets ``checkpoint_manifest.json`` (not in Accelerate): every file's size and checksum, which
        ``load_state`` checks first. ``checksum`` is CRC-32 by default, computed while the files are written (it
        finds corruption: a torn write, a flipped bit); ``checksum="sha256"`` gives digests ``sha256sum``
        reproduces, at about twice the cost; ``checksum=None`` records sizes only. See
        :mod:`lightning_accel.checkpoint.manifest`.
        """
        return self._checkpoints.save_state(
            output_dir,
            safe_serialization,
            step=self.step,
            async_save=async_save,
            checksum=checksum,
            engine_kwargs=save_model_func_kwargs,
        )

    def wait_for_checkpoint(self) -> None:
        """Block until the pending ``save_state(async_save=True)`` is written and published (not in Accelerate).

        Raises what went wrong in the background (a full disk, say). ``save_state``, ``load_state`` and
        ``end_training`` call it first. Collective where the save was (automatic naming: every process saved).
        """
        self._checkpoints.wait_for_checkpoint()

    @overload
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: Literal[False] = False,
        resume_position: bool = False,
        weights_only: bool | None = None,
        **load_model_func_kwargs: Any,
    ) -> str: ...

    @overload
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool,
        resume_position: bool = False,
        weights_only: bool | None = None,
        **load_model_func_kwargs: Any,
    ) -> str | None: ...

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool = False,
        resume_position: bool = False,
        weights_only: bool | None = None,
        **load_model_func_kwargs: Any,
    ) -> str | None:
        """Load a checkpoint written by :meth:`save_state` (or by HF accelerate); returns its directory.

        ``load_kwargs`` go to the ``torch.load`` of the optimizer, scheduler and loader files, and
        ``load_model_func_kwargs`` to DeepSpeed's ``load_checkpoint``. With ``missing_ok=True`` (not in Accelerate),
        nothing to load (no ``input_dir`` folder; with automatic naming, no ``checkpoint_<i>`` yet) returns ``None``
        instead of raising.

        Each prepared data loader gets back its epoch (Accelerate restores none), and its next iteration starts at
        the epoch's first batch, as Accelerate's: the loop skips the batches it already trained on itself
        (``skip_first_batches``, or ``continue`` while ``step < resume_step`` as diffusers' scripts do). With
        ``resume_position=True`` (not in Accelerate) the loaders also resume at the batch they had reached, for a
        loop that does not skip: one ``accelerator.load_state(missing_ok=True, resume_position=True)`` before such a
        loop starts a fresh run and resumes one that ``lightning-accel launch --max_restarts N`` restarted exactly.
        ``skip_first_batches`` after a ``resume_position=True`` load skips from the epoch's first batch too.

        Every file is read weights-only (unlike Accelerate): a file holding other objects than tensors, numbers,
        strings, containers and the few types ``save_state`` writes is refused, naming the file.
        ``weights_only=False`` (not in Accelerate) unpickles a folder you trust in full, with a warning naming each
        file; Accelerate's ``load_kwargs={"weights_only": False}`` does so for the optimizer, scheduler and loader
        files only.

        Raises:
            ValueError: For a missing folder or file, a refused file (``UnsafeCheckpointError``), or
                ``weights_only`` and ``load_kwargs["weights_only"]`` that disagree.

        """
        restored = self._checkpoints.load_state(
            input_dir,
            load_kwargs,
            missing_ok=missing_ok,
            resume_position=resume_position,
            weights_only=weights_only,
            engine_kwargs=load_model_func_kwargs,
        )
        if restored is None:
            return None
        if restored.step is not None:
            self.step = restored.step
        return restored.folder

    # ---- trackers ------------------------------------------------------------------------------------------------

    @property
    def log_with(self) -> list[str | GeneralTracker]:
        """The trackers :meth:`init_trackers` starts (names and objects)."""
        return self._trackers.log_with

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers started on this process (none but on the main process), finished ones included."""
        return self._trackers.started

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start every tracker of ``log_with`` (on the main process) and store ``config`` in each.

        Args:
            project_name: The run's project (wandb project, MLflow experiment, TensorBoard sub-directory).
            config: Hyperparameters to record.
            init_kwargs: Per tracker name, keyword arguments for its constructor (e.g. ``{"wandb": {"dir": ...}}``).

        Raises:
            ValueError: On every process, if a tracker needs a logging directory and none is configured.
            TypeError: On every process, if ``init_kwargs`` does not map names to dictionaries or a tracker's
                constructor does not take its keywords.

        """
        self._trackers.init_trackers(project_name, config, init_kwargs)

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` to every started tracker (on the main process)."""
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its underlying object with ``unwrap``); a no-op tracker elsewhere.

        Raises:
            ValueError: On the main process, when no tracker has that name.

        """
        return self._trackers.get_tracker(name, unwrap)

    # ---- collectives ---------------------------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` from all processes along dim 0."""
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: on the last batch, drop the samples repeated to even out the processes."""
        leaves_are_tensors = _all_tensors(input_data)
        use_object = use_gather_object or not leaves_are_tensors
        data = operations.gather_object(input_data) if use_object else self.gather(input_data)
        remainder = self.gradient_state.remainder
        if not self.gradient_state.end_of_dataloader or remainder <= 0:
            return data
        if use_object:
            return data[:remainder]
        return operations.recursively_apply(lambda t: t[:remainder], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` over processes (``"sum"`` by default, as Accelerate's ``Accelerator.reduce``)."""
        return operations.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad ``tensor`` along ``dim`` to the largest size over processes."""
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # ---- models, memory, end ---------------------------------------------------------------------------------------

    def unwrap_model(self, model: Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Module:
        """The user's own module, without the Fabric and strategy wrappers (and ``torch.compile``'s unless kept)."""
        if isinstance(model, PipelineEngine):  # a pipeline stage's engine holds Fabric's wrapper
            model = model.module
        return extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the references this accelerator holds, collect garbage and reset :attr:`step`."""
        self._prepared.clear()
        self.step = 0
        gc.collect()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()
        return [None for _ in objects]

    clear = free_memory

    def end_training(self) -> None:
        """Finish the run: finish a background save, close the trackers, destroy the process group.

        A process group that a ``debug_launcher`` owns is left to it. The host memory that asynchronous saves keep
        for the next one is given back.
        """
        self._checkpoints.end()
        self._trackers.finish()
        self.state.destroy_process_group()


class _Accumulation:
    """:meth:`Accelerator.accumulate`'s context (a small class rather than a generator: it is entered every step).

    Entering it runs the micro-step's decision; where the micro-step does not synchronise, the models' ``no_sync``
    contexts are held until it exits.
    """

    __slots__ = ("_accelerator", "_no_sync", "_targets")

    def __init__(self, accelerator: Accelerator, models: tuple[Module, ...]) -> None:
        self._accelerator = accelerator
        self._targets = models
        self._no_sync: ExitStack | None = None

    def __enter__(self) -> None:
        accelerator = self._accelerator
        models: Sequence[Module] = self._targets
        for model in models:
            if not isinstance(model, _FabricModule):  # a DeepSpeed engine or a plain module: find its wrapper
                models = self._prepared()
                break
        if accelerator._do_sync() or accelerator._syncs_each_batch():
            return
        with ExitStack() as stack:
            for model in models:
                stack.enter_context(accelerator.no_sync(model))
            self._no_sync = stack.pop_all()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        no_sync = self._no_sync
        if no_sync is None:
            return False
        self._no_sync = None
        return bool(no_sync.__exit__(exc_type, exc, traceback))

    def _prepared(self) -> list[Module]:
        """Fabric's wrappers of the models (a DeepSpeed engine's, a plain module's); refuses one never prepared."""
        accelerator = self._accelerator
        engines_unwrapped = [accelerator._returned.wrapper_of(model) for model in self._targets]
        return _module.prepared_models(engines_unwrapped, accelerator._prepared.models)


def _is_raw_optimizer(obj: Any) -> bool:
    return isinstance(obj, Optimizer) and not isinstance(obj, (AcceleratedOptimizer, _FabricOptimizer))


def _all_tensors(data: Any) -> bool:
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(_all_tensors(item) for item in data.values())
    return isinstance(data, torch.Tensor)
