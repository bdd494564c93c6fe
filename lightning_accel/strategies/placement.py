"""Which device a process trains on and how many replicas share the data, read from its cluster environment.

Lightning's parallel strategies index the devices they counted on this machine with the process's local rank
(``parallel_devices[local_rank]``) and size the data sampler as ``num_nodes * len(parallel_devices)``. Both break
where a cluster environment starts the processes and shows each one only its own device (Ray Train's workers,
a scheduler that gives each task one GPU, CPU workers that each count one CPU): the local rank is 1 but one device
is visible, and the world is larger than the devices counted. Every ``acc_*`` multi-process strategy takes its device
and its replica count here instead, from the environment's ranks and world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment


class _Placed(Protocol):
    """The parts of a Lightning parallel strategy (Trainer or Fabric) that :class:`ClusterPlacement` reads."""

    cluster_environment: ClusterEnvironment | None

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...


def process_device(devices: Sequence[torch.device] | None, local_rank: int, environment: str) -> torch.device:
    """The device of the process with ``local_rank`` among the ``devices`` Lightning chose on its machine.

    The device at the local rank when there is one; the only device when the process sees one (a cluster
    environment that gives each process its own device, as Ray Train does).

    Args:
        devices: The devices Lightning's accelerator connector chose (``Trainer(devices=...)``).
        local_rank: The process's index on its machine, from the cluster environment.
        environment: The cluster environment's class name, for the error.

    Raises:
        ValueError: If no devices were chosen, or several were and none is at the local rank.

    """
    if not devices:
        raise ValueError(f"No devices to place local rank {local_rank} on; pass `devices=` to the Trainer or Fabric.")
    if local_rank < len(devices):
        return devices[local_rank]
    if len(devices) == 1:
        return devices[0]
    raise ValueError(
        f"{environment} gives this process local rank {local_rank}, but only {len(devices)} devices were chosen"
        f" on its machine ({[str(d) for d in devices]}). Pass `devices=` with one device per process on the"
        " machine, or `devices='auto'` where the environment shows each process only its own device."
    )


class ClusterPlacement:
    """The root device from the cluster environment's local rank (listed before Lightning's strategy among the bases).

    It replaces Lightning's ``root_device`` (``parallel_devices[local_rank]``, an ``IndexError`` when each
    process sees one device) with :func:`process_device`.
    """

    @property
    def root_device(self: _Placed) -> torch.device:
        """The device this process trains on (see :func:`process_device`)."""
        environment = type(self.cluster_environment).__name__
        return process_device(self.parallel_devices, self.local_rank, environment)


class ClusterReplicas:
    """The data sampler's replicas from the cluster environment's world size, for the data-parallel families.

    Lightning's ``num_nodes * num_processes`` counts the devices on one machine (one under Ray Train, so every
    worker would read the whole data set); the environment's world size is the number of processes that share it.
    Lightning's count stays where no environment is attached yet (a strategy built but not set up).
    """

    @property
    def distributed_sampler_kwargs(self: _Placed) -> dict[str, Any]:
        """``num_replicas`` (the environment's world size) and ``rank`` (the global rank) for ``DistributedSampler``."""
        if self.cluster_environment is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": self.cluster_environment.world_size(), "rank": self.global_rank}
