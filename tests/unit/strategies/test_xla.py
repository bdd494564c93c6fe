"""``acc_xla`` (``DistributedType.XLA``) on torch_xla's PJRT CPU runtime, against plain PyTorch on CPU.

Runs where torch_xla is installed (``tests/xla_stage.sh`` builds a virtual environment with torch 2.9.0 and
torch-xla 2.9.0 and sets ``PJRT_DEVICE=CPU``); elsewhere the registry and the missing-package errors are checked.
One process, one device: torch-xla 2.9.0's CPU client has no cross-process collectives (see the module docstring
of ``lightning_accel.strategies.xla``), so several replicas are refused, not tested.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel
from lightning_accel import trainer_kwargs
from lightning_accel.enums import DistributedType
from lightning_accel.strategies import strategy_for
from tests.helpers import ACCELERATE_CONFIGS

FIXTURES = ACCELERATE_CONFIGS
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed (tests/xla_stage.sh installs it)")
STEPS, BATCH, LR = 4, 8, 0.1


def test_registered_for_trainer_and_fabric() -> None:
    assert "acc_xla" in StrategyRegistry and "acc_xla" in FABRIC_STRATEGY_REGISTRY
    entry = lightning_accel.strategies.entry_for(DistributedType.XLA)
    assert entry.name == "acc_xla"


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed")
@pytest.mark.parametrize("fabric", [False, True])
def test_missing_torch_xla_names_the_install(fabric: bool) -> None:
    with pytest.raises(ModuleNotFoundError, match=r"`pip install torch-xla`"):
        strategy_for("XLA", fabric=fabric)


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed")
def test_the_name_without_torch_xla_names_the_install() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"`pip install torch-xla`"):
        L.Trainer(strategy="acc_xla", logger=False)
    with pytest.raises(ModuleNotFoundError, match=r"`pip install torch-xla`"):
        L.Fabric(strategy="acc_xla")


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed")
def test_a_tpu_config_file_asks_for_torch_xla() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"`pip install torch-xla`"):
        trainer_kwargs(config=FIXTURES / "tpu.yaml", environ={})


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(STEPS * BATCH, 8, generator=generator)
    return TensorDataset(inputs, torch.randn(STEPS * BATCH, 2, generator=generator))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def plain_pytorch() -> tuple[list[float], dict[str, torch.Tensor]]:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in DataLoader(data(), batch_size=BATCH):
        loss = nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.losses: list[float] = []
        self.device_types: set[str] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.device_types |= {x.device.type, self.net[0].weight.device.type}
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach().cpu()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def assert_same(losses: list[float], weights: dict[str, torch.Tensor]) -> None:
    expected_losses, expected_weights = plain_pytorch()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=1e-5)
    assert weights.keys() == expected_weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected_weights[key], rtol=0, atol=1e-5, msg=key)


@needs_xla
@pytest.mark.parametrize("by_name", [True, False], ids=["name", "object"])
def test_trainer_on_one_pjrt_cpu_device_trains_like_plain_pytorch(by_name: bool) -> None:
    from lightning_accel.strategies.xla import PJRTAccelerator

    assert os.environ.get("PJRT_DEVICE") == "CPU", "run with PJRT_DEVICE=CPU (tests/xla_stage.sh sets it)"
    module = Regressor()
    trainer = L.Trainer(
        # By name, Lightning picks CPUAccelerator first; the strategy keeps its PJRT accelerator.
        strategy="acc_xla" if by_name else strategy_for("XLA"),
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert trainer.strategy.distributed_type == DistributedType.XLA
    assert isinstance(trainer.accelerator, PJRTAccelerator)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    assert trainer.strategy.root_device.type == "xla"
    assert module.device_types == {"xla"}  # batches and weights (Lightning moves the module back to CPU at the end)
    assert len(module.losses) == STEPS
    assert_same(module.losses, {k.removeprefix("net."): v.cpu() for k, v in module.state_dict().items()})


@needs_xla
def test_a_trainer_asking_for_two_devices_is_refused() -> None:
    # By name the connector counts CPU devices (devices=2 gives two); the strategy would use the first only.
    trainer = L.Trainer(strategy="acc_xla", devices=2, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"gave it 2: pass devices=1"):
        trainer.fit(Regressor(), DataLoader(data(), batch_size=BATCH))


def fabric_for(how: str) -> L.Fabric:
    from lightning_accel.strategies.xla import FabricPJRTAccelerator

    if how == "object":
        return L.Fabric(strategy=strategy_for("XLA", fabric=True), devices=1)
    return L.Fabric(strategy="acc_xla", accelerator=FabricPJRTAccelerator(), devices=1)


@needs_xla
@pytest.mark.parametrize("how", ["object", "name"])
def test_fabric_on_one_pjrt_cpu_device_trains_like_plain_pytorch(how: str) -> None:
    from lightning_accel.strategies.xla import FabricPJRTAccelerator

    fabric = fabric_for(how)
    assert fabric.strategy.distributed_type == DistributedType.XLA
    assert isinstance(fabric.accelerator, FabricPJRTAccelerator) and fabric.device.type == "xla"
    # Moving to an XLA device makes new parameters: the optimizer is built on the moved module, as Lightning asks.
    net = fabric.setup_module(model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=BATCH))
    losses = []
    for x, y in loader:
        assert x.device.type == "xla"
        loss = nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach().cpu()))
    assert_same(losses, {k: v.cpu() for k, v in net.state_dict().items()})


@needs_xla
def test_fabric_by_name_alone_names_the_accelerator_to_pass() -> None:
    # Fabric keeps the CPUAccelerator its connector chose for a name, so the strategy cannot swap it: it refuses it.
    with pytest.raises(ValueError, match=r"accelerator=FabricPJRTAccelerator\(\)"):
        L.Fabric(strategy="acc_xla")


@needs_xla
@pytest.mark.parametrize("fabric", [False, True])
def test_a_non_xla_accelerator_is_refused(fabric: bool) -> None:
    from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDA
    from lightning.pytorch.accelerators import CUDAAccelerator

    accelerator = FabricCUDA() if fabric else CUDAAccelerator()
    with pytest.raises(ValueError, match=r"CUDAAccelerator"):
        strategy_for("XLA", fabric=fabric, accelerator=accelerator)


@needs_xla
@pytest.mark.parametrize("fabric", [False, True])
def test_several_cpu_processes_are_refused(fabric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's processes would each be a world of 1 on PJRT's CPU client and train apart.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2: torch-xla's CPU runtime has no cross-process collectives"):
        strategy_for("XLA", fabric=fabric)
