"""``acc_auto``: the strategy the launch environment describes.

In a process started by ``lightning-accel launch`` (or ``accelerate launch``), ``Trainer(strategy="acc_auto")`` builds
``acc_fsdp`` with the ``FSDP_*`` settings when ``ACCELERATE_USE_FSDP`` is set, ``acc_deepspeed`` with the
``ACCELERATE_DEEPSPEED_*`` settings when ``ACCELERATE_USE_DEEPSPEED`` is set, data parallel (``acc_multi_cpu`` with
``ACCELERATE_USE_CPU``, else ``acc_ddp`` on the accelerator's devices) for several processes, and ``acc_no`` for one.
:mod:`lightning_accel.utils.environment` reads the variables.

The name picks the strategy only: ``accelerator``, ``devices``, ``num_nodes`` and ``precision`` stay ``Trainer``
arguments (Lightning sets them on the strategy after building it), so pass them too, or take them all from
``lightning_accel.trainer_kwargs()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, cast

from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch.strategies import Strategy

from lightning_accel.strategies.protocol import ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry

_ConfigSource = str | os.PathLike[str] | Any


class _BuiltFromEnvironment:
    """Construction of an ``acc_auto`` class: it returns the strategy the environment describes, not an instance.

    ``_fabric`` says whether the Trainer or the Fabric strategy is built.
    """

    _fabric: ClassVar[bool]

    def __new__(  # type: ignore[misc]
        cls,
        *,
        strategy_name: str = "acc_auto",
        config_file: _ConfigSource | None = None,
        environ: Mapping[str, str] | None = None,
        **options: Any,
    ) -> Strategy | FabricStrategy:
        """Return the strategy :func:`~lightning_accel.strategies.from_settings.strategy_from_env` builds."""
        from lightning_accel.strategies.from_settings import strategy_from_env

        del strategy_name  # the built strategy keeps its own name
        return strategy_from_env(fabric=cls._fabric, config=config_file, environ=environ, **options)


class AcceleratedAutoStrategy(_BuiltFromEnvironment, Strategy):
    """Builds the Trainer strategy the environment describes; constructing it returns that strategy.

    Args:
        strategy_name: Set by the registry (the built strategy keeps its own name, such as ``"acc_fsdp"``).
        config_file: An Accelerate config file (or loaded config) whose values the environment overrides.
        environ: The environment to read instead of ``os.environ``.
        **options: Strategy arguments that win over the environment, such as ``fsdp_plugin=...``; a plugin also
            selects its type.

    Raises:
        ValueError: If the variables are invalid or name a type without a strategy yet.

    """

    _fabric = False


class FabricAcceleratedAutoStrategy(_BuiltFromEnvironment, FabricStrategy, ShimStrategyDefaults):
    """Fabric twin of :class:`AcceleratedAutoStrategy`; constructing it returns the Fabric strategy."""

    _fabric = True


# The classes only dispatch in `__new__` and are never instantiated themselves, so their abstract methods stay unset.
ENTRIES = (
    StrategyEntry(
        "acc_auto",
        cast("type[Strategy]", AcceleratedAutoStrategy),
        cast("type[FabricStrategy]", FabricAcceleratedAutoStrategy),
        "The strategy `lightning-accel launch` / `accelerate launch` configured (FSDP, DeepSpeed, DDP or one device)",
    ),
)
