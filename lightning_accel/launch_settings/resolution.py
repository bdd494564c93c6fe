"""Launch settings: the run's configuration read from the environment and resolved against the config file.

``lightning-accel launch`` (like ``accelerate launch``) hands a run's configuration to its processes as environment
variables: ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_FSDP`` with ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` with
``ACCELERATE_DEEPSPEED_*``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ``ACCELERATE_DYNAMO_*``, ``ACCELERATE_USE_CPU``,
...; ``torch.distributed.run`` adds ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``. This module turns them
into settings (the flat names of :mod:`lightning_accel.config._settings`) and ``Accelerator`` arguments, with the
precedence **explicit arguments > environment > config file**, and writes them for the launcher. Every function takes
``environ`` (default: ``os.environ``) so it can be called on any mapping.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_accel.config import _arguments
from lightning_accel.config._settings import (
    PLUGIN_BY_TYPE,
    SETTINGS,
    int_parser,
    parse_bool,
    parse_setting,
    section_settings,
)
from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.launch_settings.env import _environ

if TYPE_CHECKING:
    from lightning_accel.config.file import AccelerateConfig
    from lightning_accel.config.parallelism import ParallelismConfig

__all__ = [
    "accelerator_kwargs",
    "cpu_threads_per_process",
    "default_config_file",
    "env_from_settings",
    "parallelism_config_from_env",
    "resolve_settings",
    "settings_from_env",
    "write_basic_config",
]

_TYPE_FLAGS: dict[str, DistributedType] = {
    "ACCELERATE_USE_DEEPSPEED": DistributedType.DEEPSPEED,
    "ACCELERATE_USE_FSDP": DistributedType.FSDP,
    "ACCELERATE_USE_MEGATRON_LM": DistributedType.MEGATRON_LM,
}
_FLAG_BY_TYPE = {dtype: flag for flag, dtype in _TYPE_FLAGS.items()}
_PARALLELISM_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"
# Variables of a family count only when the family's flag is set, as in Accelerate.
_GATES = {
    "FSDP_": "ACCELERATE_USE_FSDP",
    "ACCELERATE_DEEPSPEED_": "ACCELERATE_USE_DEEPSPEED",
    "MEGATRON_LM_": "ACCELERATE_USE_MEGATRON_LM",
    "PARALLELISM_CONFIG_": _PARALLELISM_FLAG,
}
# Accelerate's FSDP plugin reads these only with fsdp_version 1 (its launcher sets them for version 2 too).
_FSDP1_ONLY = (
    "fsdp_sharding_strategy",
    "fsdp_backward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_sync_module_states",
    "fsdp_forward_prefetch",
)
# Variables the launcher sets only when on; the reader treats a missing one as off.
_ONLY_WHEN_ON = {"ACCELERATE_DEBUG_MODE": "true", "ACCELERATE_CPU_AFFINITY": "1"}
_DYNAMO_DEFAULTS = {
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "false",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "false",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "false",
}
_TYPE_BY_PLUGIN_OPTION = {entry.option: dtype for dtype, entry in PLUGIN_BY_TYPE.items()}
# Accelerator arguments that are objects used as given, not settings, and select no type.
_OBJECT_OPTIONS = ("dynamo_plugin", "parallelism_config")
_POSITIVE = int_parser(minimum=1)
_NON_NEGATIVE = int_parser(minimum=0)


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """Accelerate's default config file: ``$HF_HOME/accelerate/default_config.yaml``.

    ``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, and ``XDG_CACHE_HOME`` to ``~/.cache``.
    """
    env = _environ(environ)
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | Literal[False]:
    """Accelerate's ``write_basic_config``: a config for this machine, by default at :func:`default_config_file`.

    See :func:`lightning_accel.config.write_machine_config` (it never overwrites a file; ``False`` when one exists).
    """
    from lightning_accel.config.file import write_machine_config

    return write_machine_config(mixed_precision, default_config_file() if save_location is None else save_location)


def cpu_threads_per_process(environ: Mapping[str, str] | None = None) -> int:
    """Threads per process for the launcher: ``OMP_NUM_THREADS`` when set, else 1 (as ``accelerate launch``)."""
    return int(_POSITIVE("OMP_NUM_THREADS", _environ(environ).get("OMP_NUM_THREADS", "1")))


def _flag_set(env: Mapping[str, str], name: str) -> bool:
    return name in env and parse_bool(name, env[name])


def _gate_open(variable: str, env: Mapping[str, str]) -> bool:
    return all(_flag_set(env, flag) for prefix, flag in _GATES.items() if variable.startswith(prefix))


def _type_from_flags(env: Mapping[str, str]) -> DistributedType | None:
    chosen = [(flag, dtype) for flag, dtype in _TYPE_FLAGS.items() if _flag_set(env, flag)]
    if len(chosen) > 1:
        raise ValueError(
            f"{' and '.join(flag for flag, _ in chosen)} are all set; a run uses one of FSDP, DeepSpeed or Megatron-LM"
        )
    return chosen[0][1] if chosen else None


def _read_variables(env: Mapping[str, str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for setting in SETTINGS:
        names = (setting.env,) if isinstance(setting.env, str) else setting.env or ()
        present = [name for name in names if name in env]
        if not present or not _gate_open(present[0], env):
            continue
        if len(names) == 1:
            settings[setting.name] = setting.parse(names[0], env[names[0]])
        else:
            settings[setting.name] = setting.parse(", ".join(names), [env.get(name, "false") for name in names])
    return settings


def _read_torchrun(env: Mapping[str, str], settings: dict[str, Any]) -> None:
    """Processes, machines and this machine's rank, from the variables ``torch.distributed.run`` sets."""
    if "WORLD_SIZE" in env:
        world = _POSITIVE("WORLD_SIZE", env["WORLD_SIZE"])
        settings["num_processes"] = world
        if "LOCAL_WORLD_SIZE" in env:
            settings["num_machines"] = max(world // _POSITIVE("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"]), 1)
    if "GROUP_RANK" in env:
        settings["machine_rank"] = _NON_NEGATIVE("GROUP_RANK", env["GROUP_RANK"])


def _apply_fsdp_reading_rules(settings: dict[str, Any]) -> None:
    """Read the ``FSDP_*`` values as Accelerate's FSDP plugin does for the version they give."""
    if settings.get("fsdp_version", 1) == 2:
        for name in _FSDP1_ONLY:
            settings.pop(name, None)
        return
    reshard = settings.get("fsdp_reshard_after_forward")
    if isinstance(reshard, bool):  # the launcher's "true" default; FSDP1 takes a strategy name here
        del settings["fsdp_reshard_after_forward"]
    elif reshard is not None:  # names the strategy, and wins over the launcher's FSDP_SHARDING_STRATEGY default
        settings.pop("fsdp_sharding_strategy", None)


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment gives (only those it sets).

    ``distributed_type`` comes from ``ACCELERATE_USE_FSDP`` / ``_DEEPSPEED`` / ``_MEGATRON_LM``; a family's variables
    (``FSDP_*``, ``ACCELERATE_DEEPSPEED_*``, ...) count only when its flag is set; ``num_processes``,
    ``num_machines`` and ``machine_rank`` come from torchrun's ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK``. With ``ACCELERATE_USE_PARALLELISM_CONFIG`` the ``PARALLELISM_CONFIG_*`` sizes are read, those
    left out being 1 (as Accelerate's ``ParallelismConfig`` reads them).

    Raises:
        ValueError: If a variable has an invalid value (the message names it) or several type flags are set.

    """
    env = _environ(environ)
    settings = _read_variables(env)
    if _flag_set(env, _PARALLELISM_FLAG):
        settings = _arguments.with_parallelism_defaults(settings)
    dtype = _type_from_flags(env)
    if dtype is not None:
        settings["distributed_type"] = dtype
    if dtype == DistributedType.FSDP:
        _apply_fsdp_reading_rules(settings)
    _read_torchrun(env, settings)
    return settings


def parallelism_config_from_env(environ: Mapping[str, str] | None = None) -> ParallelismConfig | None:
    """The ``ParallelismConfig`` a launch hands its processes (what Accelerate's ``Accelerator`` builds from it).

    ``ACCELERATE_USE_PARALLELISM_CONFIG`` turns it on; ``PARALLELISM_CONFIG_DP_REPLICATE_SIZE``, ``_DP_SHARD_SIZE``,
    ``_TP_SIZE``, ``_CP_SIZE`` (1 when unset), ``_CP_BACKEND``, ``_CP_COMM_STRATEGY``, ``_SP_*`` fill it.

    Returns:
        ``None`` when ``ACCELERATE_USE_PARALLELISM_CONFIG`` is not set to a true word.

    Raises:
        ValueError: If a variable has an invalid value (the message names it) or the sizes contradict each other.

    """
    env = _environ(environ)
    if not _flag_set(env, _PARALLELISM_FLAG):
        return None
    return _arguments.parallelism_config(settings_from_env(env))


def resolve_settings(
    explicit: Mapping[str, Any] | None = None,
    *,
    config: AccelerateConfig | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Merge settings: ``explicit`` over the environment over the config file.

    Args:
        explicit: Settings by flat name (``mixed_precision="bf16"``, ``fsdp_version=2``, ...); ``None`` values are
            ignored.
        config: A config (or the path of a file) giving the lowest-precedence values.
        environ: The environment to read (default ``os.environ``).

    Returns:
        The merged settings. Without a type from any source, a multi-process run (``WORLD_SIZE`` > 1) is
        ``MULTI_CPU`` with ``use_cpu`` and data parallel on the accelerator's devices (``None``) otherwise; a single
        process is ``NO``.

    Raises:
        ValueError: If an explicit name is unknown or a value invalid.

    """
    settings: dict[str, Any] = {}
    if config is not None:
        settings.update(_as_config(config).settings())
    settings.update(settings_from_env(environ))
    for name, value in (explicit or {}).items():
        if value is not None:
            settings[name] = parse_setting(name, value)
    if "distributed_type" not in settings:
        multi_process = settings.get("num_processes", 1) > 1
        settings["distributed_type"] = (
            (DistributedType.MULTI_CPU if settings.get("use_cpu") else None) if multi_process else DistributedType.NO
        )
    return settings


def _as_config(config: AccelerateConfig | str | os.PathLike[str]) -> AccelerateConfig:
    from lightning_accel.config.file import AccelerateConfig, load_config

    return config if isinstance(config, AccelerateConfig) else load_config(config)


def accelerator_kwargs(
    explicit: Mapping[str, Any] | None = None,
    *,
    config: AccelerateConfig | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``Accelerator`` arguments from explicit arguments > environment > config file.

    Args:
        explicit: ``Accelerator`` arguments the caller passed: ``mixed_precision``, ``cpu``,
            ``gradient_accumulation_steps`` and plugin objects (``fsdp_plugin``, ``deepspeed_plugin``,
            ``megatron_lm_plugin``, ``dynamo_plugin``, ``parallelism_config``); an explicit type plugin selects its
            type. ``None`` values mean "not given".
        config: An optional config file (or its path) below the environment.
        environ: The environment to read (default ``os.environ``).

    Raises:
        ValueError: For unknown argument names or invalid values.

    """
    given = {name: value for name, value in (explicit or {}).items() if value is not None}
    plugins = {name: given.pop(name) for name in (*_TYPE_BY_PLUGIN_OPTION, *_OBJECT_OPTIONS) if name in given}
    flat = {("use_cpu" if name == "cpu" else name): value for name, value in given.items()}
    for option, dtype in _TYPE_BY_PLUGIN_OPTION.items():
        if option in plugins:
            flat["distributed_type"] = dtype
    return _arguments.accelerator_kwargs(resolve_settings(flat, config=config, environ=environ), plugins)


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def _active_sections(settings: Mapping[str, Any]) -> set[str | None]:
    active: set[str | None] = {None, "dynamo_config"}
    dtype = settings.get("distributed_type")
    if dtype in PLUGIN_BY_TYPE:
        active.add(PLUGIN_BY_TYPE[dtype].section)
    if settings.get("mixed_precision") == PrecisionType.FP8:
        active.add("fp8_config")
    if _arguments.uses_parallelism(settings):
        active.add("parallelism_config")
    return active


def env_from_settings(settings: Mapping[str, Any]) -> dict[str, str]:
    """The variables ``accelerate launch`` sets for these settings, for the processes ``lightning-accel launch`` starts.

    The active type's family (``FSDP_*`` for FSDP, ``ACCELERATE_DEEPSPEED_*`` for DeepSpeed, ...) is written with its
    flag, FP8 variables with ``mixed_precision: fp8``, ``ACCELERATE_USE_PARALLELISM_CONFIG`` and the
    ``PARALLELISM_CONFIG_*`` sizes and backends (defaults filled, as ``--use_parallelism_config`` passes them) with a
    ``parallelism_config``, and ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_CPU`` and the ``ACCELERATE_DYNAMO_*``
    variables always.
    """
    env: dict[str, str] = {}
    if _arguments.uses_parallelism(settings):
        settings = _arguments.with_parallelism_defaults(settings)
        env[_PARALLELISM_FLAG] = "true"
    env.update(_setting_variables(settings))
    _keep_only_when_on(env)
    env.update(_type_variables(settings))
    env.setdefault("ACCELERATE_MIXED_PRECISION", PrecisionType.NO.value)
    env["ACCELERATE_USE_CPU"] = _env_text(_arguments.accelerator_name(settings) == "cpu")
    for name, default in _DYNAMO_DEFAULTS.items():
        env.setdefault(name, default)
    return env


def _setting_variables(settings: Mapping[str, Any]) -> dict[str, str]:
    """The variable of every given setting in an active section (a tuple setting fills several variables)."""
    env: dict[str, str] = {}
    active = _active_sections(settings)
    for setting in SETTINGS:
        if setting.env is None or setting.section not in active or setting.name not in settings:
            continue
        value = settings[setting.name]
        if isinstance(setting.env, tuple):
            env.update({name: _env_text(part) for name, part in zip(setting.env, value, strict=True)})
        else:
            env[setting.env] = _env_text(value)
    return env


def _keep_only_when_on(env: dict[str, str]) -> None:
    """Variables the launcher sets only when on: their "on" text when true, left out otherwise."""
    for name, on in _ONLY_WHEN_ON.items():
        if name in env:
            if env[name] == "true":
                env[name] = on
            else:
                del env[name]


def _type_variables(settings: Mapping[str, Any]) -> dict[str, str]:
    """The distributed type's flag, and for DeepSpeed the config-file fields the launcher passed."""
    env: dict[str, str] = {}
    dtype = settings.get("distributed_type")
    if dtype in _FLAG_BY_TYPE:
        env[_FLAG_BY_TYPE[dtype]] = "true"
    if dtype == DistributedType.DEEPSPEED:
        fields = [s.key for s in section_settings("deepspeed_config") if s.name in settings]
        if "mixed_precision" in settings:
            fields.append("mixed_precision")
        env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields)
    return env
