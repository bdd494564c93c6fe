"""TorchDynamoPlugin under acc_* strategies: compiled training gives eager's losses; regional compilation."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel
from lightning_accel.strategies import AcceleratedSingleDeviceStrategy
from lightning_accel.strategies.compile import apply_dynamo, compile_regions_in_place
from lightning_accel.utils import TorchDynamoPlugin

FLAGS = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(plugin: TorchDynamoPlugin | None) -> Stack:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 1, generator=g))
    module = Stack()
    strategy = AcceleratedSingleDeviceStrategy(dynamo_plugin=plugin)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, **FLAGS).fit(
        module, DataLoader(data, batch_size=8)
    )
    return module


@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_training_matches_eager(backend: str, regional: bool) -> None:
    torch._dynamo.reset()
    compiled = fit(TorchDynamoPlugin(backend=backend, use_regional_compilation=regional))
    eager = fit(None)
    targets = list(compiled.blocks) if regional else [compiled.blocks, compiled.head]
    assert all(m._compiled_call_impl is not None for m in targets)
    assert eager.blocks[0]._compiled_call_impl is None
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=0, atol=1e-6)


def test_regional_compilation_traces_the_repeated_block_once() -> None:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = Stack()
    compiled = compile_regions_in_place(model, backend="eager")
    assert compiled == list(model.blocks)
    # Every block sees the same kind of input (a tensor that requires grad), so one graph serves all three.
    model(torch.randn(4, 16, requires_grad=True))
    assert counters["stats"]["unique_graphs"] == 1


def test_fabric_strategy_compiles_the_module() -> None:
    plugin = TorchDynamoPlugin(backend="eager")
    fabric = L.Fabric(
        accelerator="cpu", devices=1, strategy=lightning_accel.strategy_for("NO", fabric=True, dynamo_plugin=plugin)
    )
    net = nn.Linear(4, 2)
    model = fabric.setup_module(net)
    assert net._compiled_call_impl is not None
    assert model(torch.randn(3, 4)).shape == (3, 2)


def test_no_backend_or_no_plugin_leaves_the_module_alone_and_bad_types_are_refused() -> None:
    net = nn.Linear(2, 2)
    assert apply_dynamo(net, TorchDynamoPlugin()) is net
    assert net._compiled_call_impl is None
    with pytest.raises(TypeError, match="`dynamo_plugin` must be a TorchDynamoPlugin, got dict"):
        apply_dynamo(net, {"backend": "eager"})  # type: ignore[arg-type]
