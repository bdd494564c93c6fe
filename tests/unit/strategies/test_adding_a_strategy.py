"""docs/development.md's "Adding a strategy", followed with a strategy defined here: steps 1 to 3 and nothing else.

The strategy is a backend of ``DistributedType.NO`` whose one implementation (the family object) counts the modules it
wraps; the twins subclass ``acc_no``'s and the entry is added as ``strategies/__init__.py`` adds every family's.
Nothing outside the listed files is touched: the Trainer, Fabric and the shim's protocol find it by name.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_accel.strategies import registry
from lightning_accel.strategies.protocol import as_shim_strategy
from lightning_accel.strategies.registry import StrategyEntry, add_entry, register_strategies
from lightning_accel.strategies.single_device import (
    AcceleratedSingleDeviceStrategy,
    FabricAcceleratedSingleDeviceStrategy,
)


class CountingFamily:
    """Step 1: the one implementation both twins share."""

    wrapped = 0

    @classmethod
    def wrap(cls, module: nn.Module) -> nn.Module:
        cls.wrapped += 1
        return module


class TrainerCountingStrategy(AcceleratedSingleDeviceStrategy):
    """Step 2: the Trainer twin."""

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.model is not None
        self.model = CountingFamily.wrap(self.model)
        super().setup(trainer)


class FabricCountingStrategy(FabricAcceleratedSingleDeviceStrategy):
    """Step 2: the Fabric twin."""

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return super().setup_module(CountingFamily.wrap(module))


ENTRIES = (StrategyEntry("acc_counting", TrainerCountingStrategy, FabricCountingStrategy, "Counts wrapped modules"),)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Step 3, undone afterwards: the entries go into the name table and Lightning's registries."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    CountingFamily.wrapped = 0
    for entry in ENTRIES:
        add_entry(entry)
    register_strategies()
    yield
    for table in (StrategyRegistry, FABRIC_STRATEGY_REGISTRY):
        table.pop("acc_counting", None)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    @override
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = _Regression()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data())
    expected = TrainerCountingStrategy if strategy == "acc_counting" else AcceleratedSingleDeviceStrategy
    assert type(trainer.strategy) is expected
    return model.layer.weight.detach().clone()


def _fabric_step(strategy: str) -> torch.Tensor:
    torch.manual_seed(0)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    as_shim_strategy(fabric.strategy)  # the Accelerator's protocol, answered by the inherited defaults
    layer = nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    for x, y in _data():
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return layer.weight.detach().clone()


@pytest.mark.usefixtures("registered")
def test_a_strategy_added_by_the_guide_runs_under_its_name_in_the_trainer_and_fabric() -> None:
    assert torch.equal(_fit("acc_counting"), _fit("acc_no"))
    assert CountingFamily.wrapped == 1
    assert torch.equal(_fabric_step("acc_counting"), _fabric_step("acc_no"))
    assert CountingFamily.wrapped == 2
    assert isinstance(L.Fabric(strategy="acc_counting", accelerator="cpu", devices=1).strategy, FabricCountingStrategy)
