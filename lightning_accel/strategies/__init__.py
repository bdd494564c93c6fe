"""Lightning strategies for every Accelerate ``DistributedType`` that lightning_accel implements.

Each family module (``single_device``, ``ddp``, ...) lists its names in ``ENTRIES``; importing this package adds them
to the name table, and :func:`register_strategies` copies the table into Lightning's registries.
"""

from lightning_accel.strategies import (
    auto,
    ddp,
    deepspeed,
    device_map,
    fsdp,
    megatron,
    parallel,
    single_device,
    xla,
)
from lightning_accel.strategies.checkpoint_io import AsyncNamingCheckpointIO
from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.fsdp import AcceleratedFSDPStrategy, FabricAcceleratedFSDPStrategy
from lightning_accel.strategies.parallel import AcceleratedParallelStrategy, FabricAcceleratedParallelStrategy
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

for _family in (single_device, ddp, fsdp, deepspeed, parallel, auto, device_map, xla, megatron):
    for _entry in _family.ENTRIES:
        add_entry(_entry)

__all__ = [
    "AcceleratedDDPStrategy",
    "AcceleratedFSDPStrategy",
    "AcceleratedParallelStrategy",
    "AcceleratedSingleDeviceStrategy",
    "AsyncNamingCheckpointIO",
    "FabricAcceleratedDDPStrategy",
    "FabricAcceleratedFSDPStrategy",
    "FabricAcceleratedParallelStrategy",
    "FabricAcceleratedSingleDeviceStrategy",
    "StrategyEntry",
    "add_entry",
    "entries",
    "entry_for",
    "register_strategies",
    "strategy_for",
]
