"""The name table: which strategy class serves each ``acc_*`` name and each :class:`DistributedType`.

Lightning keeps separate strategy registries for the Trainer and Fabric; every entry here goes into both.
:func:`strategy_for` is how the config-file and shim code turn a ``DistributedType`` into a strategy without
branching on the type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_accel.enums import DistributedType


@dataclass(frozen=True)
class StrategyEntry:
    """One registered name.

    Attributes:
        name: The registered name (lower case), e.g. ``"acc_multi_cpu"``.
        trainer_cls: The ``lightning.pytorch`` strategy class.
        fabric_cls: The ``lightning.fabric`` strategy class.
        description: One line shown by Lightning's registries.
        distributed_type: The Accelerate type the name stands for, or ``None`` for names that derive it (``acc_ddp``).
        init_params: Constructor arguments the name fixes.

    """

    name: str
    trainer_cls: type[Strategy]
    fabric_cls: type[FabricStrategy]
    description: str
    distributed_type: DistributedType | None = None
    init_params: Mapping[str, Any] = field(default_factory=dict)

    def params(self, **options: Any) -> dict[str, Any]:
        """Constructor arguments: the entry's own, overridden by ``options``."""
        return {"strategy_name": self.name, **self.init_params, **options}


_ENTRIES: dict[str, StrategyEntry] = {}


def add_entry(entry: StrategyEntry) -> None:
    """Add a name to the table (and, once :func:`register_strategies` ran, to Lightning's registries).

    Raises:
        ValueError: If the name is taken by another entry.

    """
    existing = _ENTRIES.get(entry.name)
    if existing is not None and existing != entry:
        raise ValueError(f"Strategy name {entry.name!r} is already registered for {existing.trainer_cls.__name__}.")
    _ENTRIES[entry.name] = entry


def entries() -> tuple[StrategyEntry, ...]:
    """Every entry, in registration order."""
    return tuple(_ENTRIES.values())


def register_strategies() -> None:
    """Put every entry into the Trainer's and Fabric's strategy registries (idempotent)."""
    for entry in _ENTRIES.values():
        StrategyRegistry.register(
            entry.name, entry.trainer_cls, description=entry.description, override=True, **entry.params()
        )
        FABRIC_STRATEGY_REGISTRY.register(
            entry.name, entry.fabric_cls, description=entry.description, override=True, **entry.params()
        )


def strategy_for(distributed_type: DistributedType | str, *, fabric: bool = False, **options: Any) -> Any:
    """Build the strategy that runs ``distributed_type``.

    Args:
        distributed_type: An Accelerate type such as ``DistributedType.MULTI_CPU`` or ``"FSDP"``.
        fabric: Return the Fabric strategy instead of the Trainer one.
        **options: Constructor arguments, e.g. ``ddp_kwargs=DistributedDataParallelKwargs(...)``.

    Returns:
        A fresh strategy instance, to pass as ``Trainer(strategy=...)`` or ``Fabric(strategy=...)``.

    Raises:
        ValueError: If the type is unknown, or no strategy for it exists yet.

    """
    entry = entry_for(distributed_type)
    cls = entry.fabric_cls if fabric else entry.trainer_cls
    return cls(**entry.params(**options))


def entry_for(distributed_type: DistributedType | str) -> StrategyEntry:
    """The table entry whose ``distributed_type`` matches.

    Raises:
        ValueError: If the type is unknown, or no strategy for it exists yet.

    """
    try:
        wanted = DistributedType(distributed_type.upper() if isinstance(distributed_type, str) else distributed_type)
    except ValueError:
        allowed = ", ".join(t.value for t in DistributedType)
        raise ValueError(f"Unknown distributed type {distributed_type!r}; expected one of {allowed}.") from None
    for entry in _ENTRIES.values():  # the first entry of a type is its canonical name
        if entry.distributed_type == wanted:
            return entry
    available = ", ".join(e.distributed_type.value for e in _ENTRIES.values() if e.distributed_type is not None)
    raise ValueError(
        f"lightning_accel has no strategy for DistributedType.{wanted.value} yet; available types: {available}."
    )
