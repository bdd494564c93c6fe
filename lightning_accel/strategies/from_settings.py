"""Strategies, precision plugins and ``lightning.Trainer`` arguments from flat settings and the launch environment.

This is the layer above the config data: :mod:`lightning_accel.config` reads and validates settings, and this module
turns them into Lightning objects through the strategy registry (which also raises the error for types that have no
strategy yet). ``L.Trainer(**trainer_kwargs())`` in a script started by ``lightning-accel launch`` trains with the
launcher's processes, strategy and precision; ``strategy="acc_auto"`` builds :func:`strategy_from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_accel.config._arguments import (
    accelerator_name,
    check_supported,
    distributed_type,
    fp8_recipe,
    lightning_precision,
    parallelism_config,
    processes_per_node,
    uses_parallelism,
)
from lightning_accel.config._settings import PLUGIN_BY_TYPE, build_dynamo_plugin
from lightning_accel.launch_settings import resolve_settings
from lightning_accel.precision import FP8Precision
from lightning_accel.strategies.lightning_arguments import keyword_names
from lightning_accel.strategies.registry import StrategyEntry, entries, entry_for

if TYPE_CHECKING:
    from lightning_accel.config.file import AccelerateConfig

__all__ = [
    "build_strategy",
    "precision_plugins",
    "settings_trainer_kwargs",
    "strategy_entry",
    "strategy_from_env",
    "strategy_options",
    "trainer_kwargs",
]

_DATA_PARALLEL_ON_ANY_DEVICE = "acc_ddp"
_PARALLELISM = "acc_parallel"
_TYPE_BY_PLUGIN_OPTION = {entry.option: dtype for dtype, entry in PLUGIN_BY_TYPE.items()}


def precision_plugins(settings: Mapping[str, Any]) -> list[Any]:
    """The Trainer ``plugins`` a precision needs: an ``FP8Precision`` built from ``fp8_config`` for ``fp8``, else none.

    Raises:
        ValueError: For the MS-AMP backend, which lightning_accel does not run.
        ModuleNotFoundError: If the backend's package (torchao or transformer_engine) is not installed.

    """
    if lightning_precision(settings.get("mixed_precision")) is not None:
        return []
    backend, recipe = fp8_recipe(settings)
    return [FP8Precision(backend, recipe)]


def strategy_entry(settings: Mapping[str, Any], *, parallel: bool = False) -> StrategyEntry:
    """The registry entry of the settings' strategy.

    ``acc_parallel`` when the settings hold a ``parallelism_config`` (or ``parallel`` is set: the caller passes a
    ``ParallelismConfig``), ``acc_ddp`` for a ``None`` type, else the type's strategy.

    Raises:
        ValueError: If lightning_accel has no strategy for the type yet.

    """
    if parallel or uses_parallelism(settings):
        return _named(_PARALLELISM)
    dtype = distributed_type(settings)
    if dtype is None:
        return _named(_DATA_PARALLEL_ON_ANY_DEVICE)
    return entry_for(dtype)


def _named(name: str) -> StrategyEntry:
    return next(e for e in entries() if e.name == name)


def strategy_options(settings: Mapping[str, Any], *, fabric: bool = False, **options: Any) -> dict[str, Any]:
    """The arguments the settings give the strategy: the type's plugin and, when compiling, ``dynamo_plugin``.

    With a ``parallelism_config`` (``acc_parallel``) they are the ``ParallelismConfig`` and, for ``distributed_type``
    ``FSDP``, the ``fsdp_config`` section's plugin. ``options`` are kept as given and win over the settings.

    Raises:
        ValueError: See :func:`build_strategy`.

    """
    check_supported(settings)
    # the "no strategy for this type yet" error comes before any plugin is built
    entry = strategy_entry(settings, parallel="parallelism_config" in options)
    dtype = distributed_type(settings)
    plugin = PLUGIN_BY_TYPE.get(dtype) if dtype is not None else None
    if entry.name == _PARALLELISM:
        if "parallelism_config" not in options:
            options["parallelism_config"] = parallelism_config(settings)
        if plugin is not None and plugin.option != "fsdp_plugin":
            raise ValueError(
                f"a ParallelismConfig runs on acc_parallel, which takes no {plugin.option}; drop the parallelism_config"
                f" or use distributed_type FSDP (fsdp_version 2) instead of {getattr(dtype, 'value', dtype)}"
            )
    if plugin is not None and plugin.option not in options:
        options[plugin.option] = plugin.build(settings)
    _add_dynamo_plugin(settings, entry.name, entry.fabric_cls if fabric else entry.trainer_cls, options)
    return options


def build_strategy(settings: Mapping[str, Any], *, fabric: bool = False, **options: Any) -> Any:
    """The Trainer (or Fabric) strategy the settings describe, configured with :func:`strategy_options`.

    Args:
        settings: Flat settings.
        fabric: Return the Fabric strategy.
        **options: Strategy arguments that take precedence over the settings (an explicit ``fsdp_plugin``, ...).

    Raises:
        ValueError: If the type has no strategy yet, the strategy cannot apply the dynamo settings, or the settings
            are unsupported or invalid.

    """
    options = strategy_options(settings, fabric=fabric, **options)
    entry = strategy_entry(settings, parallel="parallelism_config" in options)
    return (entry.fabric_cls if fabric else entry.trainer_cls)(**entry.params(**options))


def _add_dynamo_plugin(settings: Mapping[str, Any], name: str, cls: type, options: dict[str, Any]) -> None:
    backend = settings.get("dynamo_backend", "NO")
    if backend == "NO" or "dynamo_plugin" in options:
        return
    if "dynamo_plugin" not in keyword_names(cls):
        raise ValueError(
            f"dynamo_config asks for torch.compile (backend {backend!r}), but {name} does not apply it yet; remove "
            "dynamo_config (or set dynamo_backend: 'NO') and call torch.compile on your model yourself"
        )
    options["dynamo_plugin"] = build_dynamo_plugin(settings)


def settings_trainer_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``lightning.Trainer`` arguments: accelerator, devices, num_nodes, strategy, precision (and accumulation).

    Raises:
        ValueError: See :func:`lightning_precision`, :func:`processes_per_node`, :func:`accelerator_name` and
            :func:`build_strategy`.

    """
    precision = lightning_precision(settings.get("mixed_precision"))  # checked before any strategy is built
    plugins = precision_plugins(settings)
    kwargs: dict[str, Any] = {
        "accelerator": accelerator_name(settings),
        "devices": processes_per_node(settings),
        "num_nodes": settings.get("num_machines", 1),
        "strategy": build_strategy(settings),
    }
    if plugins:
        kwargs["plugins"] = plugins
    else:
        kwargs["precision"] = precision
    accumulation = settings.get("gradient_accumulation_steps")
    if isinstance(accumulation, int):
        kwargs["accumulate_grad_batches"] = accumulation
    return kwargs


def trainer_kwargs(
    *,
    config: AccelerateConfig | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **explicit: Any,
) -> dict[str, Any]:
    """``lightning.Trainer`` arguments for a run started by ``lightning-accel launch`` (or ``accelerate launch``).

    ``L.Trainer(**trainer_kwargs(), max_epochs=3)`` trains with the launcher's processes, strategy and precision.

    Args:
        config: An optional config file (or its path) below the environment.
        environ: The environment to read (default ``os.environ``).
        **explicit: Settings that win over both, by flat name (``mixed_precision="bf16"``, ...).

    Returns:
        accelerator, devices, num_nodes, strategy and precision (and accumulate_grad_batches when the launcher set
        ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``).

    Raises:
        ValueError: For invalid settings or types without a strategy yet.

    """
    return settings_trainer_kwargs(resolve_settings(explicit, config=config, environ=environ))


def strategy_from_env(
    *,
    fabric: bool = False,
    config: AccelerateConfig | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> Any:
    """The strategy the environment describes (what ``strategy="acc_auto"`` builds).

    Args:
        fabric: Return the Fabric strategy instead of the Trainer one.
        config: An optional config file (or its path) below the environment.
        environ: The environment to read (default ``os.environ``).
        **options: Strategy arguments that win over the environment; a plugin (``fsdp_plugin=...``,
            ``deepspeed_plugin=...``) also selects its type.

    Raises:
        ValueError: For invalid variables or types without a strategy yet.

    """
    given = {name: value for name, value in options.items() if value is not None}
    implied = [dtype for option, dtype in _TYPE_BY_PLUGIN_OPTION.items() if option in given]
    flat = {"distributed_type": implied[0]} if implied else {}
    settings = resolve_settings(flat, config=config, environ=environ)
    return build_strategy(settings, fabric=fabric, **given)
