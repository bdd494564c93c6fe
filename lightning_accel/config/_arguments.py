"""What flat settings (see :mod:`lightning_accel.config._settings`) say, as data.

The Trainer precision string, the processes per node, the accelerator name and the ``Accelerator``'s arguments.
Building strategies and precision plugins from settings is a layer above, in
:mod:`lightning_accel.strategies.from_settings`. A ``distributed_type`` of ``None`` means "data parallel on whatever
devices the accelerator gives" (``acc_ddp``): the environment of a multi-process launch that names no type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from lightning_accel.config._settings import PLUGIN_BY_TYPE, build_dynamo_plugin, section_settings
from lightning_accel.config.parallelism import ParallelismConfig
from lightning_accel.enums import DistributedType, PrecisionType

_LIGHTNING_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_PARALLELISM_SECTION = "parallelism_config"
# What `accelerate launch --use_parallelism_config` passes for the options it is not given.
_PARALLELISM_DEFAULTS: dict[str, Any] = {
    "parallelism_config_dp_replicate_size": 1,
    "parallelism_config_dp_shard_size": 1,
    "parallelism_config_tp_size": 1,
    "parallelism_config_cp_size": 1,
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_sp_size": 1,
    "parallelism_config_sp_backend": "deepspeed",
}


def lightning_precision(mixed_precision: str | None) -> str | None:
    """The Trainer ``precision`` for Accelerate's ``mixed_precision`` (``None`` means ``"no"``).

    ``acc_*`` strategies turn these strings into lightning_accel's precision plugins. ``fp8`` has no Lightning string:
    it is ``None`` here and comes as a plugin (:func:`precision_plugins`).

    Raises:
        ValueError: For an unknown value.

    """
    value = PrecisionType.NO.value if mixed_precision is None else str(mixed_precision).lower()
    if value == PrecisionType.FP8.value:
        return None
    if value not in _LIGHTNING_PRECISION:
        raise ValueError(f"mixed_precision must be one of {PrecisionType.list()}, got {mixed_precision!r}")
    return _LIGHTNING_PRECISION[value]


def fp8_recipe(settings: Mapping[str, Any]) -> tuple[Literal["ao", "te"], Any]:
    """The FP8 backend and its recipe kwargs (``AORecipeKwargs`` / ``TERecipeKwargs``) from ``fp8_config``.

    Raises:
        ValueError: For the MS-AMP backend, which lightning_accel does not run.

    """
    from lightning_accel.config.fp8 import AORecipeKwargs, TERecipeKwargs

    backend = str(settings.get("fp8_backend", "AO")).upper()
    if backend == "AO":
        return "ao", AORecipeKwargs(
            pad_inner_dim=settings.get("fp8_pad_inner_dim"),
            enable_fsdp_float8_all_gather=settings.get("fp8_enable_fsdp_float8_all_gather"),
        )
    if backend == "TE":
        return "te", TERecipeKwargs(**{field: settings[name] for name, field in _TE_FIELDS.items() if name in settings})
    raise ValueError(f"fp8_config backend {backend!r} is not supported; use AO (torchao) or TE (Transformer Engine)")


# Flat setting name -> TERecipeKwargs field.
_TE_FIELDS = {
    "fp8_use_autocast_during_eval": "use_autocast_during_eval",
    "fp8_margin": "margin",
    "fp8_interval": "interval",
    "fp8_format": "fp8_format",
    "fp8_amax_history_len": "amax_history_len",
    "fp8_amax_compute_algo": "amax_compute_algo",
    "fp8_override_linear_precision": "override_linear_precision",
}


def distributed_type(settings: Mapping[str, Any]) -> DistributedType | None:
    """The configured type; ``NO`` when none is given, ``None`` for data parallel on the accelerator's devices."""
    return settings.get("distributed_type", DistributedType.NO)


def processes_per_node(settings: Mapping[str, Any]) -> int:
    """``num_processes // num_machines``, checked.

    Raises:
        ValueError: If ``num_processes`` is ``-1`` (unknown), not a multiple of ``num_machines``, or above 1 with
            ``distributed_type: NO``.

    """
    total = settings.get("num_processes", 1)
    machines = settings.get("num_machines", 1)
    if total is None or total < 1:
        raise ValueError(
            f"num_processes is {total}: set it in the config file or pass `--num_processes` to lightning-accel launch"
        )
    if total % machines:
        raise ValueError(f"num_processes ({total}) must be a multiple of num_machines ({machines})")
    per_node = total // machines
    if per_node > 1 and distributed_type(settings) == DistributedType.NO:
        raise ValueError(
            f"distributed_type NO runs one process per machine, but num_processes is {total} on {machines} "
            "machine(s); use MULTI_CPU / MULTI_GPU (or `--cpu` / `--multi_gpu`), FSDP or DEEPSPEED"
        )
    return per_node


def accelerator_name(settings: Mapping[str, Any]) -> str:
    """The Trainer ``accelerator``: ``"cpu"`` with ``use_cpu``, the type's device for ``MULTI_*``, else ``"auto"``.

    Raises:
        ValueError: If ``use_cpu`` is set with a type that trains on another device (``MULTI_GPU``, ...).

    """
    from lightning_accel.config.devices import BACKEND_BY_TYPE

    dtype = distributed_type(settings)
    backend = BACKEND_BY_TYPE.get(dtype) if dtype is not None else None
    if settings.get("use_cpu"):
        if backend is not None and backend.device_type != "cpu":
            raise ValueError(
                f"use_cpu is true, but distributed_type {backend.distributed_type.value} trains on "
                f"{backend.device_type!r} devices; use MULTI_CPU (or set use_cpu: false)"
            )
        return "cpu"
    return backend.device_type if backend is not None else "auto"


def uses_parallelism(settings: Mapping[str, Any]) -> bool:
    """Whether the settings hold a ``parallelism_config`` (any ``parallelism_config_*`` value)."""
    return any(s.name in settings for s in section_settings(_PARALLELISM_SECTION))


def with_parallelism_defaults(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings with ``accelerate launch --use_parallelism_config``'s values for what they leave out.

    Sizes are 1 and the backends ``torch`` (context) and ``deepspeed`` (sequence); ``cp_comm_strategy`` is
    ``allgather`` when ``cp_size`` is above 1. Given values are kept.
    """
    merged = {**_PARALLELISM_DEFAULTS, **settings}
    if merged["parallelism_config_cp_size"] > 1:
        merged.setdefault("parallelism_config_cp_comm_strategy", "allgather")
    return merged


def parallelism_config(settings: Mapping[str, Any]) -> ParallelismConfig | None:
    """The :class:`~lightning_accel.config.ParallelismConfig` the ``parallelism_config_*`` settings describe.

    Returns:
        ``None`` when the settings hold none (:func:`uses_parallelism`).

    Raises:
        ValueError: If the sizes contradict each other (``ParallelismConfig``'s own checks).

    """
    from lightning_accel.config.file import parallelism_config_from_section

    section = {s.key: settings[s.name] for s in section_settings(_PARALLELISM_SECTION) if s.name in settings}
    return parallelism_config_from_section(section)


def check_supported(settings: Mapping[str, Any]) -> None:
    """Refuse settings no lightning_accel strategy implements.

    A ``parallelism_config`` runs on ``acc_parallel``: with ``distributed_type`` ``FSDP`` (``fsdp_version`` 2, a
    shard dimension to shard over, as Accelerate checks), data parallel (``MULTI_CPU``, ``MULTI_GPU``, ...) or
    ``NO``; its sizes must multiply to ``num_processes`` (or be all 1: replication over every process).

    Raises:
        ValueError: If the ``parallelism_config`` is invalid, asks for DeepSpeed sequence parallelism, contradicts
            the distributed type, or does not fit the number of processes.

    """
    config = parallelism_config(settings)
    if config is None:
        return
    if config.sp_enabled:
        raise ValueError(
            f"parallelism_config_sp_size is {config.sp_size}, but DeepSpeed sequence parallelism (ALST/Ulysses) is "
            "not supported by lightning_accel; set parallelism_config_sp_size: 1"
        )
    _check_parallel_type(settings, config)
    processes = settings.get("num_processes", 1)
    if config.total_size > 1 and processes not in (None, -1) and processes != config.total_size:
        raise ValueError(
            f"parallelism_config multiplies to {config.total_size} processes (dp_replicate {config.dp_replicate_size}"
            f" x dp_shard {config.dp_shard_size} x cp {config.cp_size} x tp {config.tp_size}), but num_processes is "
            f"{processes}; make them equal (set num_processes / `--num_processes`, or adjust the sizes)"
        )


def _check_parallel_type(settings: Mapping[str, Any], config: ParallelismConfig) -> None:
    from lightning_accel.config.devices import BACKEND_BY_TYPE

    dtype = distributed_type(settings)
    if dtype is None or dtype == DistributedType.NO or dtype in BACKEND_BY_TYPE:
        return
    if dtype != DistributedType.FSDP:
        raise ValueError(
            f"parallelism_config runs on acc_parallel, which composes with FSDP (fsdp_version 2) or data parallel "
            f"types (MULTI_CPU, MULTI_GPU, ...), not with distributed_type {dtype.value}; change distributed_type "
            "or remove the parallelism_config section"
        )
    version = settings.get("fsdp_version", 1)
    if version != 2:
        raise ValueError(
            f"parallelism_config shards with FSDP2 on a device mesh, but fsdp_version is {version}; set "
            "fsdp_config.fsdp_version: 2 (`--fsdp_version 2`)"
        )
    if not (config.dp_shard_enabled or config.cp_enabled):
        raise ValueError(
            "distributed_type is FSDP, but parallelism_config has no dimension for FSDP to shard across (both "
            "parallelism_config_dp_shard_size and parallelism_config_cp_size are 1), which Accelerate refuses too; "
            "set parallelism_config_dp_shard_size above 1, or use MULTI_CPU / MULTI_GPU for tensor parallelism alone"
        )


def accelerator_kwargs(settings: Mapping[str, Any], plugins: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``Accelerator`` arguments: mixed_precision, cpu, the type's plugins, parallelism_config, accumulation.

    Args:
        settings: Flat settings.
        plugins: Plugin objects given explicitly (``fsdp_plugin``, ``dynamo_plugin``, ``parallelism_config``, ...);
            they are used as they are instead of being built from the settings.

    Raises:
        ValueError: If the settings are unsupported (:func:`check_supported`) or a plugin is invalid.

    """
    check_supported(settings)
    mixed_precision = settings.get("mixed_precision")
    kwargs: dict[str, Any] = {
        "mixed_precision": PrecisionType.NO.value if mixed_precision is None else str(mixed_precision),
        "cpu": accelerator_name(settings) == "cpu",
    }
    given = dict(plugins or {})
    dtype = distributed_type(settings)
    plugin = PLUGIN_BY_TYPE.get(dtype) if dtype is not None else None
    if plugin is not None and plugin.option not in given:
        kwargs[plugin.option] = plugin.build(settings)
    if "dynamo_plugin" not in given and any(s.name in settings for s in section_settings("dynamo_config")):
        kwargs["dynamo_plugin"] = build_dynamo_plugin(settings)
    if "parallelism_config" not in given and uses_parallelism(settings):
        kwargs["parallelism_config"] = parallelism_config(settings)
    kwargs.update(given)
    accumulation = settings.get("gradient_accumulation_steps")
    if isinstance(accumulation, int):
        kwargs["gradient_accumulation_steps"] = accumulation
    return kwargs
