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
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import TracebackType
from typing import Any, cast

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_accel._shim import engine_step as _engine_step
from lightning_accel._shim import fabric as _fabric
from lightning_accel._shim import lomo as _lomo
from lightning_accel._shim import module as _module
from lightning_accel._shim import parallelism as _parallelism
from lightning_accel._shim.arguments import (
    check_arguments,
    check_type,
    named_trackers,
    parallelism_from_tp_plugin,
    refuse_unsupported,
    with_split_batches,
)
from lightning_accel._shim.checkpoint_control import CheckpointControl
from lightning_accel._shim.deepspeed_members import ReturnedModels, ulysses_loader
from lightning_accel._shim.gradients import GradientClipping, raw_optimizer
from lightning_accel._shim.loader_control import DataLoaderControl
from lightning_accel._shim.module import (
    AcceleratedModule,
    check_quantized_placement,
    distributed_data_parallel,
    evaluation_module,
    plain_optimizer_step,
)
from lightning_accel._shim.parallelism import ParallelismControl
from lightning_accel._shim.precision_members import PrecisionMembers, check_fp8_handlers, handler_attributes
from lightning_accel._shim.prepared import PreparedObjects
from lightning_accel._shim.process import ProcessControl
from lightning_accel._shim.profiling import profiled
from lightning_accel.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    KwargsHandler,
    MegatronLMPlugin,
    ParallelismConfig,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.data_loader import DataLoaderShard, check_rng_types
from lightning_accel.enums import DynamoBackend
from lightning_accel.launch_settings import accelerator_kwargs, settings_from_env
from lightning_accel.lightning_compat import get_backward_sync_control
from lightning_accel.optimizer import AcceleratedOptimizer, DeepSpeedOptimizerWrapper
from lightning_accel.scheduler import AcceleratedScheduler
from lightning_accel.state import AcceleratorState, GradientState
from lightning_accel.strategies.protocol import ShimStrategy, as_shim_strategy
from lightning_accel.tracking import GeneralTracker, TrackingMixin, resolve_trackers
from lightning_accel.tracking.registry import check_logging_dir
from lightning_accel.utils import modeling, operations
from lightning_accel.utils.deepspeed import DeepSpeedEngineWrapper
from lightning_accel.utils.imports import is_bitsandbytes_multi_backend_available, is_xpu_available
from lightning_accel.utils.other import extract_model_from_parallel

__all__ = ["Accelerator"]


class Accelerator(
    ProcessControl,
    TrackingMixin,
    DataLoaderControl,
    CheckpointControl,
    PrecisionMembers,
    ParallelismControl,
):
    """Accelerate's ``Accelerator`` on Lightning Fabric and lightning_accel's strategies and precision plugins.

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
        megatron_lm_plugin: Megatron-LM settings: the run uses ``acc_megatron_lm`` (tensor and data parallelism).
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
        self._adopt_handlers(handler_attributes(kwargs_handlers))
        self.rng_types = check_rng_types(["generator"] if rng_types is None else rng_types)
        self.log_with = resolve_trackers(log_with)
        self.device_placement = device_placement
        self.dataloader_config = dataloader_config
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
        self.trackers: list[GeneralTracker] = []
        self.step = 0
        self._prepared = PreparedObjects()
        # The mixins and the checkpoint code read the prepared objects by these names: the same lists.
        self._models: list[AcceleratedModule] = self._prepared.models
        self._optimizers: list[AcceleratedOptimizer] = self._prepared.optimizers
        self._schedulers: list[AcceleratedScheduler] = self._prepared.schedulers
        self._dataloaders: list[DataLoaderShard] = self._prepared.dataloaders
        self._custom_objects: list[Any] = self._prepared.custom_objects
        self._gradients = GradientClipping(self.fabric, self._strategy, self._prepared)
        self._returned = ReturnedModels(self._strategy, self._prepared)
        # OrderedDict: RemovableHandle keeps a weak reference to it, which a plain dict refuses.
        self._save_state_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()

    def _launch(self, settings: dict[str, Any], handlers: dict[str, KwargsHandler]) -> Fabric:
        """Pick the distributed type, build and launch the Fabric, and record the processes in the shared state."""
        launch = _fabric.detect_launch()
        device = _fabric.device_type(bool(settings["cpu"]))
        plugin_names = ("fsdp_plugin", "deepspeed_plugin", "megatron_lm_plugin", "dynamo_plugin", "parallelism_config")
        plugins = {name: settings.get(name) for name in plugin_names}
        dtype = _fabric.distributed_type(launch, device, plugins)
        mixed_precision = str(settings["mixed_precision"])
        check_fp8_handlers(handler_attributes(list(handlers.values())), mixed_precision, dtype)
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
    @override
    def logging_dir(self) -> str | None:
        """Directory of file-based trackers."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Index of the next automatically named checkpoint."""
        return self.project_configuration.iteration

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
        _module.reuse_prepared(objects, self._models)  # a module prepared before gets the wrapper it got then
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
        self._models.append(adopted)
        objects[index] = self._returned.returned(adopted)

    def _register_optimizer(self, optimizer: Optimizer, device_placement: bool) -> AcceleratedOptimizer:
        strategy = self.fabric.strategy
        engine, plain = self._strategy.engine_steps_in_backward, plain_optimizer_step(strategy)
        place = device_placement and not engine  # an engine (DeepSpeed) places its own optimizer state
        wrapped = (
            DeepSpeedOptimizerWrapper(optimizer, precision=strategy.precision)
            if engine
            else AcceleratedOptimizer(optimizer, place, precision=strategy.precision, plain_step=plain)
        )
        self._optimizers.append(wrapped)
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
        self._models.append(prepared)
        return prepared

    def verify_device_map(self, model: Module) -> bool:
        """Whether ``model`` was dispatched over several devices with a device map (such a model is not trained)."""
        return modeling.verify_device_map(model)

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Set up one optimizer (after its model); ``device_placement`` moves its state to :attr:`device`."""
        return self.prepare(optimizer, device_placement=None if device_placement is None else [device_placement])

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps with its prepared optimizer (a ``DummyScheduler``: the engine's)."""
        optimizers = [opt for opt in self._optimizers if raw_optimizer(opt) is scheduler.optimizer]
        wrapped = _engine_step.engine_scheduler(self._strategy, scheduler, self._optimizers) or (
            AcceleratedScheduler(scheduler, optimizers, self.step_scheduler_with_optimizer, self.split_batches)
        )
        self._schedulers.append(wrapped)
        return wrapped

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
        if self._models and self._strategy.engine_steps_in_backward:
            raise ValueError(
                "The DeepSpeed engine fixed its accumulation steps in prepare: set them before, in"
                " Accelerator(gradient_accumulation_steps=...) or the DeepSpeed config."
            )
        self.gradient_state.plugin_kwargs["num_steps"] = value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` divided by the accumulation steps, through the strategy and precision plugin.

        Engines that accumulate themselves (DeepSpeed) get it undivided and step here at sync steps, as in Accelerate.
        With a LOMO optimizer prepared, ``learning_rate=`` runs its fused backward (:meth:`lomo_backward`).
        """
        models = self._models
        if not models:
            _module.check_backward_after_prepare(models)
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
        _engine_step.step_after_backward(self._strategy, self._optimizers, self.sync_gradients)

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
        return _lomo.has_lomo_optimizer(self._optimizers)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backpropagate ``loss`` through every prepared LOMO optimizer, which updates the parameters on the way.

        Raises:
            ImportError: Without the ``lomo-optim`` package.
            ValueError: Without a learning rate, or when no prepared optimizer is a LOMO optimizer.

        """
        _lomo.lomo_backward(self._optimizers, loss, learning_rate)

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
        return any(opt.step_was_skipped for opt in self._optimizers)

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
        """Finish the run: close the trackers, destroy the process group (not one a ``debug_launcher`` owns)."""
        self._finish_trackers()
        self.state.destroy_process_group()


class _Accumulation:
    """:meth:`Accelerator.accumulate`'s context (a small class rather than a generator: it is entered every step).

    Entering it runs the micro-step's decision; where the micro-step does not synchronise, the models' ``no_sync``
    contexts are held until it exits.
    """

    __slots__ = ("_accelerator", "_models", "_no_sync")

    def __init__(self, accelerator: Accelerator, models: tuple[Module, ...]) -> None:
        self._accelerator = accelerator
        self._models = models
        self._no_sync: ExitStack | None = None

    def __enter__(self) -> None:
        accelerator = self._accelerator
        models: Sequence[Module] = self._models
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
        engines_unwrapped = [accelerator._returned.wrapper_of(model) for model in self._models]
        return _module.prepared_models(engines_unwrapped, accelerator._models)


def _is_raw_optimizer(obj: Any) -> bool:
    return isinstance(obj, Optimizer) and not isinstance(obj, (AcceleratedOptimizer, _FabricOptimizer))


def _all_tensors(data: Any) -> bool:
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(item) for item in data)
    if isinstance(data, dict):
        return all(_all_tensors(item) for item in data.values())
    return isinstance(data, torch.Tensor)
