"""The root device and the sampler's replicas come from the cluster environment (strategies/placement.py)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.placement import process_device


class _OneWorkerOfTwo(LightningEnvironment):
    """As Ray Train's environment: local rank 1 of a world of 2, whose ranks the strategy cannot set."""

    def local_rank(self) -> int:
        return 1

    def global_rank(self) -> int:
        return 1

    def world_size(self) -> int:
        return 2

    def set_global_rank(self, rank: int) -> None:
        pass

    def set_world_size(self, size: int) -> None:
        pass


def test_the_device_at_the_local_rank() -> None:
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert process_device(devices, 1, "Env") == torch.device("cuda", 1)


def test_the_only_device_a_process_sees() -> None:
    assert process_device([torch.device("cuda", 0)], 3, "Env") == torch.device("cuda", 0)


def test_several_devices_and_none_at_the_local_rank_is_an_error() -> None:
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError, match=r"RayEnv gives this process local rank 2, but only 2 devices.*`devices=`"):
        process_device(devices, 2, "RayEnv")
    with pytest.raises(ValueError, match="No devices to place local rank 0"):
        process_device([], 0, "RayEnv")


@pytest.mark.parametrize("cls", [AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy])
def test_a_worker_that_sees_one_device(cls: type) -> None:
    strategy = cls(parallel_devices=[torch.device("cpu")], cluster_environment=_OneWorkerOfTwo())
    assert strategy.root_device == torch.device("cpu")  # Lightning's parallel_devices[1] raised IndexError
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}  # Lightning's: 1 replica
