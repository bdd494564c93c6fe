"""Lightning strategies for every Accelerate ``DistributedType`` that lightning_accel implements."""

from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.registry import (
    StrategyEntry,
    add_entry,
    entries,
    entry_for,
    register_strategies,
    strategy_for,
)
from lightning_accel.strategies.single_device import (
    AcceleratedSingleDeviceStrategy,
    FabricAcceleratedSingleDeviceStrategy,
)

__all__ = [
    "AcceleratedDDPStrategy",
    "AcceleratedSingleDeviceStrategy",
    "FabricAcceleratedDDPStrategy",
    "FabricAcceleratedSingleDeviceStrategy",
    "StrategyEntry",
    "add_entry",
    "entries",
    "entry_for",
    "register_strategies",
    "strategy_for",
]
