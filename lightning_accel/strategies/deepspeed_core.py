"""The behaviour of the DeepSpeed family, written once and used by both the Trainer and the Fabric strategies.

Two steps turn a :class:`~lightning_accel.config.DeepSpeedPlugin` into the dictionary ``deepspeed.initialize`` gets:

1. :func:`resolve_config` reconciles what the config and the training loop both state (micro-batch size,
   accumulation, clipping, precision): "auto" takes the loop's value, a real conflict is a ``ValueError`` naming both
   values. ``lightning_accel.Accelerator`` fills the same entries by Accelerate's rules instead
   (:func:`~lightning_accel.strategies.deepspeed_prepare.resolve_prepare_config`).
2. :func:`fill_engine_autos` fills the entries only the model and optimizer can answer (optimizer and scheduler
   hyperparameters, hidden-size-based bucket sizes) and refuses any "auto" left.

``deepspeed`` is imported inside functions only, so importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.config import DeepSpeedPlugin, InitProcessGroupKwargs, TorchDynamoPlugin
from lightning_accel.strategies.compile import apply_dynamo
from lightning_accel.strategies.deepspeed_env import plugin_from_lightning_variable
from lightning_accel.utils.constants import WEIGHTS_NAME

_Number = TypeVar("_Number", int, float)

INSTALL_HINT = "pip install 'lightning-accel[deepspeed]'"
# Loss-scaling settings of an fp16 section this package adds (DeepSpeed's and Lightning's defaults: dynamic scaling).
_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
_OPTIMIZER_HPARAMS = ("lr", "betas", "eps", "weight_decay")
_HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
_DEVICE_TYPES = ("cpu", "cuda")


def import_deepspeed(requested_by: str) -> ModuleType:
    """Import ``deepspeed``, or explain how to install it.

    Args:
        requested_by: The strategy name shown to the user.

    Raises:
        ModuleNotFoundError: If ``deepspeed`` cannot be imported.

    """
    try:
        import deepspeed
    except ImportError as err:
        raise ModuleNotFoundError(
            f"Strategy {requested_by!r} needs the `deepspeed` package, which cannot be imported here ({err})."
            f" Install it: {INSTALL_HINT}"
        ) from err
    return deepspeed


@dataclass(frozen=True)
class TrainingFacts:
    """What the training loop states about the settings a DeepSpeed config may leave on ``"auto"``.

    Attributes:
        world_size: Number of data-parallel processes.
        device_type: ``"cpu"`` or ``"cuda"``.
        precision: Lightning's precision string, such as ``"32-true"`` or ``"bf16-mixed"``, or ``"fp8"`` (float8
            Linears inside an engine that trains in bf16, as Accelerate runs fp8 with DeepSpeed).
        micro_batch_size: Per-process batch size of the training data, or ``None`` when unknown.
        micro_batch_size_required: Whether an unknown batch size is an error (fitting with the Trainer); otherwise
            ``1`` is used, as DeepSpeed only reads it for its throughput report.
        accumulation: Micro-batches per optimizer step the loop was given (``Trainer.accumulate_grad_batches``);
            ``None`` or ``1`` means the default, which yields to a larger value in the config.
        gradient_clip_val: Max gradient norm the loop was given (``Trainer.gradient_clip_val``); ``None`` or ``0``
            means unset, which yields to the config's value.

    """

    world_size: int
    device_type: str
    precision: str = "32-true"
    micro_batch_size: int | None = None
    micro_batch_size_required: bool = False
    accumulation: int | None = None
    gradient_clip_val: float | None = None


def resolve_config(config: Mapping[str, Any], facts: TrainingFacts) -> dict[str, Any]:
    """Reconcile a DeepSpeed config with the training loop: the one place batch sizes and accumulation are decided.

    Rules: an ``"auto"`` (or absent) entry takes the loop's value. For accumulation and clipping, ``1`` / ``0`` are
    everyone's defaults, so the side that sets a real value wins; two different real values are a conflict. The
    micro-batch size must equal the data's batch size, and ``train_batch_size`` must equal
    micro-batch size x accumulation x world size.

    Args:
        config: The DeepSpeed config (not modified).
        facts: What the loop states.

    Returns:
        A new config with those entries concrete.

    Raises:
        ValueError: On a conflict, naming both values and how to fix it.

    """
    resolved = copy.deepcopy(dict(config))
    accumulation = _reconcile_accumulation(resolved.get("gradient_accumulation_steps", "auto"), facts.accumulation)
    micro = _reconcile_micro_batch(resolved.get("train_micro_batch_size_per_gpu", "auto"), facts)
    expected_total = micro * accumulation * facts.world_size
    total = resolved.get("train_batch_size", "auto")
    if total not in ("auto", None) and total != expected_total:
        raise ValueError(
            f"DeepSpeed config has train_batch_size={total!r}, but the run gives micro-batch size {micro} x"
            f" accumulation {accumulation} x {facts.world_size} processes = {expected_total}. Set train_batch_size"
            " to 'auto' (or remove it), or change the batch size or accumulation so that they multiply to it."
        )
    resolved["gradient_accumulation_steps"] = accumulation
    resolved["train_micro_batch_size_per_gpu"] = micro
    resolved["train_batch_size"] = expected_total
    resolved["gradient_clipping"] = _reconcile_clipping(resolved.get("gradient_clipping", "auto"), facts)
    resolve_precision(resolved, facts.precision)
    resolved.setdefault("zero_allow_untested_optimizer", True)
    resolved.setdefault("zero_optimization", {})
    keep_torch_optimizer_on_cpu(resolved, facts.device_type)
    return resolved


def keep_torch_optimizer_on_cpu(config: dict[str, Any], device_type: str) -> None:
    """With optimizer offload on CPU devices, keep the torch optimizer (``zero_force_ds_cpu_optimizer: false``).

    The "offloaded" optimizer runs where it ran anyway, so a torch optimizer is not slower, and DeepSpeed's CPU Adam
    would need a C++ toolchain to build.
    """
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if device_type == "cpu" and offload.get("device", "none") not in ("none", None):
        config.setdefault("zero_force_ds_cpu_optimizer", False)


def _reconcile_with_loop(configured: Any, loop_value: _Number, neutral: _Number, conflict: str) -> _Number:
    """The config's value against the loop's: ``"auto"`` and a value the other side leaves ``neutral`` give way.

    Raises:
        ValueError: With ``conflict`` as its message, if both sides set different values.

    """
    if configured in ("auto", None):
        return loop_value
    if configured == loop_value or loop_value == neutral:
        return type(neutral)(configured)
    if configured == neutral:
        return loop_value
    raise ValueError(conflict)


def _reconcile_accumulation(configured: Any, from_loop: int | None) -> int:
    loop_value = from_loop or 1
    return _reconcile_with_loop(
        configured,
        loop_value,
        1,
        f"DeepSpeed config has gradient_accumulation_steps={configured!r}, but Trainer(accumulate_grad_batches="
        f"{loop_value}). Set one of them: use DeepSpeedPlugin(gradient_accumulation_steps='auto') (or 'auto' in"
        f" hf_ds_config) to follow the Trainer, or Trainer(accumulate_grad_batches={configured!r}).",
    )


def _reconcile_micro_batch(configured: Any, facts: TrainingFacts) -> int:
    if configured in ("auto", None):
        if facts.micro_batch_size is not None:
            return facts.micro_batch_size
        if facts.micro_batch_size_required:
            raise ValueError(
                "DeepSpeed config has train_micro_batch_size_per_gpu='auto', but the training DataLoader has no"
                " integer batch size to take it from. Set train_micro_batch_size_per_gpu to the per-process batch"
                " size in hf_ds_config."
            )
        return 1
    if facts.micro_batch_size is not None and configured != facts.micro_batch_size:
        raise ValueError(
            f"DeepSpeed config has train_micro_batch_size_per_gpu={configured!r}, but the training DataLoader yields"
            f" batches of {facts.micro_batch_size}. Set train_micro_batch_size_per_gpu to 'auto' (or"
            f" {facts.micro_batch_size}), or build the DataLoader with batch_size={configured!r}."
        )
    return int(configured)


def _reconcile_clipping(configured: Any, facts: TrainingFacts) -> float:
    loop_value = float(facts.gradient_clip_val or 0.0)
    return _reconcile_with_loop(
        configured,
        loop_value,
        0.0,
        f"DeepSpeed config has gradient_clipping={configured!r}, but Trainer(gradient_clip_val={loop_value})."
        " Set one of them: use DeepSpeedPlugin(gradient_clipping='auto') (or 'auto' in hf_ds_config) to follow the"
        f" Trainer, or Trainer(gradient_clip_val={configured!r}).",
    )


def resolve_precision(config: dict[str, Any], precision: str) -> None:
    """Enable the ``fp16``/``bf16`` section of ``precision`` (added if missing), fill ``"auto"``, refuse conflicts."""
    wanted = {"fp16": precision in ("16-mixed", "16-true"), "bf16": precision in ("bf16-mixed", "bf16-true", "fp8")}
    for section, enabled in wanted.items():
        key = "bfloat16" if section == "bf16" and "bfloat16" in config else section
        node = config.get(key)
        if node is None:
            if enabled:
                config[section] = {"enabled": True, **(_FP16_DEFAULTS if section == "fp16" else {})}
            continue
        if not isinstance(node, dict):
            raise ValueError(f"DeepSpeed config section {key!r} must be a dict, got {node!r}.")
        configured = node.get("enabled", "auto")
        if configured == "auto":
            node["enabled"] = enabled
        elif bool(configured) != enabled:
            hint = "bf16-mixed" if section == "bf16" else "16-mixed"
            fp8_note = " (fp8 runs DeepSpeed in bf16)" if precision == "fp8" else ""
            raise ValueError(
                f"DeepSpeed config has {key}.enabled={configured!r}, but the precision is {precision!r}{fp8_note}. Set"
                f" {key}.enabled to 'auto' to follow the precision, or pass precision={hint!r}"
                f" {'to enable' if configured else 'and remove'} it."
            )


def fill_engine_autos(
    config: Mapping[str, Any],
    *,
    optimizer_hparams: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """Fill the "auto" entries that depend on the model and optimizer, then refuse any "auto" left.

    Args:
        config: A config that went through :func:`resolve_config` (not modified).
        optimizer_hparams: The defaults of the torch optimizer the code built (``lr``, ``betas``, ``eps``,
            ``weight_decay``); they fill ``optimizer.params`` and the scheduler's ``warmup_max_lr``.
        total_steps: Optimizer steps of the whole run, for ``scheduler.params.total_num_steps``.
        hidden_size: The model's hidden size, for the ZeRO bucket sizes.

    Returns:
        A new config, free of "auto".

    Raises:
        ValueError: If a declared optimizer value conflicts with the code's optimizer, or "auto" entries remain.

    """
    filled = copy.deepcopy(dict(config))
    hparams = dict(optimizer_hparams or {})
    optimizer_params = (filled.get("optimizer") or {}).get("params")
    if isinstance(optimizer_params, dict):
        _fill_optimizer_params(optimizer_params, hparams)
    scheduler_params = (filled.get("scheduler") or {}).get("params")
    if isinstance(scheduler_params, dict):
        sources = {"warmup_min_lr": 0, "warmup_max_lr": hparams.get("lr"), "total_num_steps": total_steps}
        for name, value in sources.items():
            if scheduler_params.get(name) == "auto" and value is not None:
                scheduler_params[name] = value
    zero = filled.get("zero_optimization") or {}
    for key, size_for in _HIDDEN_SIZE_KEYS.items():
        if zero.get(key) == "auto" and hidden_size is not None:
            zero[key] = size_for(hidden_size)
    left = sorted(auto_entries(filled))
    if left:
        raise ValueError(
            f"DeepSpeed config entries {left} are 'auto', but nothing in the run gives their value (optimizer values"
            " come from the optimizer configure_optimizers returns, bucket sizes from `model.config.hidden_size`)."
            " Replace 'auto' with a concrete value in hf_ds_config."
        )
    return filled


def _fill_optimizer_params(optimizer_params: dict[str, Any], hparams: Mapping[str, Any]) -> None:
    """Fill the config optimizer's "auto" hyperparameters from the code's optimizer; refuse ones that differ."""
    for name in _OPTIMIZER_HPARAMS:
        if name not in hparams or name not in optimizer_params:
            continue
        configured, coded = optimizer_params[name], hparams[name]
        if configured == "auto":
            optimizer_params[name] = list(coded) if isinstance(coded, tuple) else coded
        elif _as_number_list(configured) != _as_number_list(coded):
            raise ValueError(
                f"DeepSpeed config has optimizer.params.{name}={configured!r}, but the optimizer returned by"
                f" configure_optimizers has {name}={coded!r}. Set it to 'auto' in hf_ds_config, or make them equal."
            )


def _as_number_list(value: Any) -> Any:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else value


def auto_entries(config: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Yield the dotted keys whose value is ``"auto"``."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from auto_entries(value, f"{prefix}{key}.")
        elif value == "auto":
            yield f"{prefix}{key}"


def without_autos(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with every ``"auto"`` entry removed (DeepSpeed's defaults apply to them)."""
    return {
        key: without_autos(value) if isinstance(value, Mapping) else value
        for key, value in config.items()
        if not (isinstance(value, str) and value == "auto")
    }


def optimizer_hparams(optimizer: Optimizer | None) -> dict[str, Any] | None:
    """The hyperparameters of ``optimizer`` that a DeepSpeed config may leave on "auto"."""
    if optimizer is None:
        return None
    return {k: v for k, v in optimizer.defaults.items() if k in _OPTIMIZER_HPARAMS}


def hidden_size_of(model: Module) -> int | None:
    """``config.hidden_size`` (or the largest ``config.hidden_sizes``) of the model or its first submodule with one."""
    for module in model.modules():
        model_config = getattr(module, "config", None)
        if isinstance(getattr(model_config, "hidden_size", None), int):
            return int(model_config.hidden_size)  # type: ignore[union-attr]
        sizes = getattr(model_config, "hidden_sizes", None)
        if isinstance(sizes, Sequence) and sizes:
            return int(max(sizes))
    return None


class DeepSpeedFamily:
    """Config, devices, engine creation, accumulation boundaries and full-weight saving of one DeepSpeed strategy.

    Args:
        strategy_name: The registered name, used in error messages.
        plugin: The DeepSpeed settings; ``None`` means the JSON file ``PL_DEEPSPEED_CONFIG_PATH`` names when it is set
            (as in Lightning), else ``DeepSpeedPlugin()`` (ZeRO stage 2).
        plugin_fields: Fields for the plugin built when ``plugin`` is ``None`` (by the ``acc_deepspeed_stage_*`` names).
        dynamo_plugin: ``torch.compile`` settings applied to the model before DeepSpeed wraps it.

    Raises:
        TypeError: If ``plugin`` is not a ``DeepSpeedPlugin``.
        ValueError: If both ``plugin`` and ``plugin_fields`` are given.
        ModuleNotFoundError: If ``deepspeed`` is not installed.

    """

    def __init__(
        self,
        strategy_name: str,
        plugin: DeepSpeedPlugin | None,
        plugin_fields: Mapping[str, Any] | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        import_deepspeed(strategy_name)
        if plugin is not None and not isinstance(plugin, DeepSpeedPlugin):
            raise TypeError(f"`deepspeed_plugin` must be a DeepSpeedPlugin, got {type(plugin).__name__}: {plugin!r}.")
        if plugin is not None and plugin_fields:
            raise ValueError(
                f"Strategy {strategy_name!r} fixes DeepSpeedPlugin fields {dict(plugin_fields)}; it cannot also take"
                " `deepspeed_plugin`. Use strategy 'acc_deepspeed' with your DeepSpeedPlugin instead."
            )
        self.strategy_name = strategy_name
        self.dynamo_plugin = dynamo_plugin
        if plugin is None:
            plugin = plugin_from_lightning_variable(strategy_name, plugin, plugin_fields)
        self.plugin = plugin if plugin is not None else DeepSpeedPlugin(**dict(plugin_fields or {}))
        self.config: dict[str, Any] = copy.deepcopy(self.plugin.deepspeed_config)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the config."""
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))

    @property
    def zero3_init_enabled(self) -> bool:
        """Whether models built in ``configure_model`` / ``init_module`` are created partitioned (ZeRO 3)."""
        return self.zero_stage == 3 and self.plugin.is_zero3_init_enabled()

    @property
    def saves_full_weights(self) -> bool:
        """Whether checkpoints also get the gathered weights (``zero3_save_16bit_model``)."""
        return bool((self.config.get("zero_optimization") or {}).get("stage3_gather_16bit_weights_on_model_save"))

    def prepare_devices(self, devices: Sequence[torch.device] | None, root_device: torch.device) -> None:
        """Check the devices, then make DeepSpeed's accelerator match them.

        Raises:
            ValueError: For devices other than CPU or CUDA.
            RuntimeError: For CUDA devices picked out of order (Lightning's check).

        """
        self.check_devices(devices or [root_device])
        self.use_device(root_device)

    def check_devices(self, devices: Sequence[torch.device]) -> None:
        """Check that the devices are CPUs, or CUDA devices whose indices equal the local ranks.

        Raises:
            ValueError: For another device type.
            RuntimeError: For CUDA devices picked out of order (Lightning's check).

        """
        device_type = devices[0].type
        if device_type not in _DEVICE_TYPES:
            raise ValueError(
                f"Strategy {self.strategy_name!r} runs on CPU or CUDA devices, got {device_type!r}. Pass"
                " `accelerator='cpu'` or `accelerator='gpu'`."
            )
        if device_type == "cuda":
            from lightning.fabric.strategies.deepspeed import _validate_device_index_selection

            _validate_device_index_selection(list(devices))

    def use_device(self, device: torch.device) -> None:
        """Make DeepSpeed's accelerator match ``device`` (it picks CUDA on its own whenever CUDA is present)."""
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if device.type == "cpu":
            _skip_inference_comm_kernel()
        if get_accelerator().device_name() == device.type:
            return
        if device.type == "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
        else:
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

            set_accelerator(CUDA_Accelerator())

    def resolve(self, facts: TrainingFacts) -> dict[str, Any]:
        """Reconcile the plugin's config with the loop (see :func:`resolve_config`) and keep the result."""
        self.config = resolve_config(self.plugin.deepspeed_config, facts)
        return self.config

    def sharded_init_context(self, remote_device: str | None = None) -> AbstractContextManager:
        """``deepspeed.zero.Init``: modules built inside are created partitioned when :attr:`zero3_init_enabled`."""
        import deepspeed

        return deepspeed.zero.Init(
            enabled=self.zero3_init_enabled, remote_device=remote_device, config_dict_or_path=without_autos(self.config)
        )

    def inference_config(self) -> dict[str, Any]:
        """The config of an engine without an optimizer (validation, testing, prediction)."""
        keys = ("fp16", "bf16", "bfloat16") + (
            ("zero_optimization", "zero_allow_untested_optimizer") * (self.zero_stage == 3)
        )
        return {"train_micro_batch_size_per_gpu": 1, **{k: self.config[k] for k in keys if k in self.config}}

    def initialize(
        self,
        model: Module,
        optimizer: Optimizer | None,
        local_rank: int,
        config: Mapping[str, Any],
        lr_scheduler: Any = None,
        model_parameters: Any = None,
    ) -> tuple[Any, Any, Any]:
        """Build the DeepSpeed engine.

        Args:
            model: The module to wrap.
            optimizer: The torch optimizer, or ``None`` when the config declares one (or for inference).
            local_rank: This process's index on its node (DeepSpeed's ``device_rank``, also on CPU).
            config: The final config (from :func:`fill_engine_autos` or :meth:`inference_config`).
            lr_scheduler: A scheduler for DeepSpeed to build or drive, if any.
            model_parameters: Parameters or groups for DeepSpeed's optimizer (else the trainable ones).

        Returns:
            The engine, DeepSpeed's optimizer and DeepSpeed's scheduler.

        """
        import deepspeed

        self.set_moe_leaf_modules(model)
        apply_dynamo(model, self.dynamo_plugin)
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=local_rank),
            config=dict(config),
            model=model,
            model_parameters=model_parameters or [p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer, ds_scheduler

    def engine_config(self, model: Module, optimizer: Optimizer | None, total_steps: int | None) -> dict[str, Any]:
        """The final training config: :attr:`config` with the model- and optimizer-dependent "auto" entries filled."""
        return fill_engine_autos(
            self.config,
            optimizer_hparams=optimizer_hparams(optimizer),
            total_steps=total_steps,
            hidden_size=hidden_size_of(model),
        )

    def set_moe_leaf_modules(self, model: Module) -> None:
        """Mark the classes named in ``transformer_moe_cls_names`` as ZeRO-3 leaf modules.

        Raises:
            ValueError: If a named class does not occur in ``model``.

        """
        names = [n.strip() for n in (self.plugin.transformer_moe_cls_names or "").split(",") if n.strip()]
        if not names:
            return
        from deepspeed.utils import set_z3_leaf_modules

        classes = {type(m).__name__: type(m) for m in model.modules()}
        missing = [n for n in names if n not in classes]
        if missing:
            raise ValueError(
                f"transformer_moe_cls_names names {missing}, which the model does not contain; its module classes"
                f" are {sorted(classes)}."
            )
        set_z3_leaf_modules(model, [classes[n] for n in names])

    def release(self, engine: Any) -> None:
        """Remove what ``engine`` hooked into its module and parameters and free its optimizer state.

        The module stays usable for a new engine: its parameters keep their current values (partitioned under ZeRO 3).
        """
        # The engine's own forward hooks (``_forward_prologue``/``_forward_epilogue``) outlive ``destroy``.
        for name in ("module_forward_pre_hook", "module_forward_post_hook"):
            handle = getattr(engine, name, None)
            if handle is not None:
                handle.remove()
                setattr(engine, name, None)
        engine.destroy()

    @contextmanager
    def accumulating(self, engine: Any) -> Iterator[None]:
        """Within this context, backward passes accumulate gradients without reaching DeepSpeed's step boundary."""
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(True)

    def no_sync(self, engine: Any, enabled: bool) -> AbstractContextManager[None]:
        """``fabric.no_backward_sync``: with ``enabled``, the backward passes inside accumulate (no boundary).

        The context is DeepSpeed's step signal, not only a communication saving: every accumulating micro-batch must
        run inside it, also with ``GradientAccumulationPlugin(sync_each_batch=True)`` (Accelerate sets the boundary
        too; the strategies say so with ``marks_step_boundary``).
        """
        return self.accumulating(engine) if enabled else nullcontext()

    def save_full_weights(self, engine: Any, directory: str | os.PathLike[str]) -> None:
        """Write the gathered weights as ``pytorch_model.bin`` into ``directory`` (collective: call on all ranks)."""
        if self.saves_full_weights:
            engine.save_16bit_model(os.fspath(directory), WEIGHTS_NAME)


def _skip_inference_comm_kernel() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce kernel when the process group starts.

    The compilation needs a C++ toolchain and takes minutes on a fresh machine, and only DeepSpeed's tensor-parallel
    inference (``inference_all_reduce``) uses the kernel; ZeRO training talks through ``torch.distributed``.
    DeepSpeed keeps its table of buildable ops in one dict meant to be edited.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def process_group_settings(
    init_kwargs: InitProcessGroupKwargs | None, backend: str | None, timeout: timedelta | None
) -> tuple[str | None, timedelta | None]:
    """The backend and timeout DeepSpeed's process group gets: ``init_kwargs``' where set, else the arguments'.

    ``deepspeed.init_distributed`` (as Lightning calls it) takes a backend and a timeout only, so an ``init_method``
    is refused rather than dropped.

    Raises:
        TypeError: If ``init_kwargs`` is not an ``InitProcessGroupKwargs``.
        ValueError: For an ``init_method``, or a backend set both here and in ``process_group_backend``, differently.

    """
    if init_kwargs is None:
        return backend, timeout
    if not isinstance(init_kwargs, InitProcessGroupKwargs):
        raise TypeError(f"init_kwargs takes an InitProcessGroupKwargs, got {type(init_kwargs).__name__}.")
    if init_kwargs.init_method is not None:
        raise ValueError(
            f"InitProcessGroupKwargs(init_method={init_kwargs.init_method!r}) cannot reach DeepSpeed's process group,"
            " which joins the launcher's env:// rendezvous (MASTER_ADDR/MASTER_PORT); drop init_method."
        )
    requested = init_kwargs.to_kwargs().get("backend")  # set only when it differs from the dataclass default
    if requested is not None and backend is not None and requested != backend:
        raise ValueError(
            f"InitProcessGroupKwargs(backend={requested!r}) and process_group_backend={backend!r} disagree; set one."
        )
    return requested or backend, init_kwargs.timeout if init_kwargs.timeout is not None else timeout


def estimated_total_steps(value: float | int) -> int | None:
    """``Trainer.estimated_stepping_batches`` as an int, ``None`` when unbounded."""
    return None if math.isinf(value) else int(value)
