"""What ``Accelerator.prepare`` registered: the state the ``Accelerator``'s collaborators share, held in one object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_accel._accelerator.module import AcceleratedModule
from lightning_accel.data_loader import DataLoaderShard
from lightning_accel.optimizer import AcceleratedOptimizer
from lightning_accel.scheduler import AcceleratedScheduler

__all__ = ["PreparedObjects"]


@dataclass(eq=False)
class PreparedObjects:
    """The objects ``prepare`` returned (and ``register_for_checkpointing`` added), each kind in preparation order.

    Attributes:
        models: Fabric's wrappers of the prepared models.
        optimizers: The prepared optimizers.
        schedulers: The prepared schedulers.
        dataloaders: The prepared data loaders.
        custom_objects: Objects registered for checkpointing.

    """

    models: list[AcceleratedModule] = field(default_factory=list)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[DataLoaderShard] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)

    def clear(self) -> None:
        """Forget the prepared models, optimizers, schedulers and loaders (``free_memory``); custom objects stay."""
        self.models.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.dataloaders.clear()
