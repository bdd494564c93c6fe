"""The ``Accelerator``'s constructor arguments: types, exclusive pairs and deprecated spellings, checked up front.

Everything here runs before the strategy starts any process, so a wrong argument fails the same way on every rank.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_accel.config import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    MegatronLMPlugin,
    ParallelismConfig,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lightning_accel.tracking import GeneralTracker, resolve_trackers

__all__ = [
    "check_arguments",
    "check_type",
    "named_trackers",
    "parallelism_from_tp_plugin",
    "refuse_unsupported",
    "with_split_batches",
]

_EXPECTED: dict[str, type] = {
    "dataloader_config": DataLoaderConfiguration,
    "project_config": ProjectConfiguration,
    "gradient_accumulation_plugin": GradientAccumulationPlugin,
    "deepspeed_plugin": DeepSpeedPlugin,
    "fsdp_plugin": FullyShardedDataParallelPlugin,
    "dynamo_plugin": TorchDynamoPlugin,
    "megatron_lm_plugin": MegatronLMPlugin,
    "parallelism_config": ParallelismConfig,
}


def check_type(name: str, value: Any, expected: type | tuple[type, ...]) -> None:
    """Refuse a ``value`` (other than ``None``) that is not an ``expected`` instance.

    Raises:
        TypeError: Naming the argument, the expected type(s) and the value.

    """
    if value is not None and not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
        raise TypeError(f"`{name}` must be a {names} (or None), got {type(value).__name__}: {value!r}.")


def check_arguments(**values: Any) -> None:
    """Check each plugin / configuration argument against its Accelerate type (see :func:`check_type`)."""
    for name, value in values.items():
        check_type(name, value, _EXPECTED[name])


def refuse_unsupported(**values: Any) -> None:
    """Refuse the Accelerator arguments lightning_accel does not run yet.

    Raises:
        NotImplementedError: Naming each given one.

    """
    given = [name for name, value in values.items() if value is not None]
    if given:
        raise NotImplementedError(
            f"Accelerator({', '.join(f'{name}=...' for name in given)}) is not supported by lightning_accel yet:"
            " use fsdp_plugin / deepspeed_plugin / parallelism_config, or Trainer(strategy='acc_fsdp')."
        )


def parallelism_from_tp_plugin(torch_tp_plugin: Any, parallelism_config: ParallelismConfig | None) -> Any:
    """Accelerate's deprecated ``torch_tp_plugin``: its ``tp_size`` becomes ``ParallelismConfig(tp_size=...)``.

    Raises:
        ValueError: If both are given, or the plugin has no positive integer ``tp_size``.

    """
    if torch_tp_plugin is None:
        return parallelism_config
    if parallelism_config is not None:
        raise ValueError("Pass torch_tp_plugin or parallelism_config, not both: use ParallelismConfig(tp_size=...).")
    tp_size = getattr(torch_tp_plugin, "tp_size", None)
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(
            f"torch_tp_plugin={torch_tp_plugin!r} has no positive integer tp_size; pass"
            " parallelism_config=ParallelismConfig(tp_size=...) instead."
        )
    warnings.warn(
        "torch_tp_plugin is deprecated in Accelerate: pass parallelism_config=ParallelismConfig(tp_size=...).",
        FutureWarning,
        stacklevel=3,
    )
    return ParallelismConfig(tp_size=tp_size)


def with_split_batches(config: DataLoaderConfiguration | None, split_batches: bool | None) -> DataLoaderConfiguration:
    """Apply the deprecated ``split_batches`` argument to the data-loader configuration.

    Raises:
        ValueError: If ``dataloader_config`` is given as well.

    """
    if split_batches is None:
        return config or DataLoaderConfiguration()
    if config is not None:
        raise ValueError(
            "Pass split_batches inside dataloader_config, not next to it: DataLoaderConfiguration(split_batches=...)."
        )
    warnings.warn(
        "Accelerator(split_batches=...) is deprecated: pass"
        " dataloader_config=DataLoaderConfiguration(split_batches=...).",
        FutureWarning,
        stacklevel=3,
    )
    return DataLoaderConfiguration(split_batches=split_batches)


def named_trackers(log_with: Any) -> list[str | GeneralTracker]:
    """The trackers Accelerate checks at construction: all of them, unless ``"all"`` is among them (resolved)."""
    given = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    if any(str(tracker).lower() == "all" for tracker in given):
        return []
    named = [tracker for tracker in given if tracker is not None]
    return resolve_trackers(named) if named else []
