"""The shim's per-step shortcuts behave as the paths they skip: Fabric's forward, clearing through Fabric's wrapper,
moving a batch that is on its device already.

``AcceleratedModule.forward`` calls the wrapped module directly only where Fabric's forward would convert nothing;
``AcceleratedOptimizer.zero_grad`` clears the user's optimizer directly where the wrapper's ``zero_grad`` is torch's.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from lightning_accel import Accelerator
from lightning_accel._accelerator.module import passes_forward_through
from lightning_accel.precision.plugins import BF16Precision, FP32Precision
from lightning_accel.utils import send_to_device


@dataclasses.dataclass(frozen=True)
class _Frozen:
    value: torch.Tensor


class _FrozenOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> _Frozen:
        return _Frozen(self.linear(x))


class _CastingInputs(FP32Precision):
    def convert_input(self, data: object) -> object:
        return data


def test_only_fp32_autocast_mode_passes_the_forward_through() -> None:
    assert passes_forward_through(FP32Precision())
    assert not passes_forward_through(BF16Precision(device="cpu"))
    assert not passes_forward_through(BF16Precision(mode="true", device="cpu"))
    assert not passes_forward_through(_CastingInputs())
    patched = FP32Precision()
    patched.forward_context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # type: ignore[method-assign]
    assert not passes_forward_through(patched)


def test_fp32_forward_gives_the_modules_own_output() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model = Accelerator(cpu=True).prepare(net)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), net(x))


def test_bf16_forward_still_runs_under_autocast() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(4, 2), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    plain = layer(x)
    output = Accelerator(cpu=True, mixed_precision="bf16").prepare(layer)(x)
    assert output.dtype == torch.float32  # Accelerate's fp32 outputs
    assert torch.equal(output, expected.float()) and not torch.equal(output, plain)


def test_a_precision_plugin_put_in_after_prepare_is_checked_again() -> None:
    """The pass-through decision is kept per plugin object: a new plugin gets Fabric's forward (autocast) again."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    assert model(x).dtype == torch.float32  # decided (and kept) for the fp32 plugin
    accelerator.fabric.strategy.precision = BF16Precision(device="cpu")
    assert model(x).dtype == torch.bfloat16


def test_a_frozen_dataclass_output_is_refused_as_by_fabric() -> None:
    model = Accelerator(cpu=True).prepare(_FrozenOutput())
    with pytest.raises(ValueError, match="frozen dataclass"):
        model(torch.randn(3, 4))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_the_users_optimizer(set_to_none: bool) -> None:
    net = nn.Linear(4, 2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(model(torch.randn(3, 4)).sum())
    optimizer.zero_grad(set_to_none=set_to_none)
    for parameter in net.parameters():
        if set_to_none:
            assert parameter.grad is None
        else:
            assert parameter.grad is not None and torch.count_nonzero(parameter.grad) == 0


def test_zero_grad_after_a_pickle_round_trip() -> None:
    net = nn.Linear(4, 2)
    _, optimizer = Accelerator(cpu=True).prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    copy = pickle.loads(pickle.dumps(optimizer))
    params = copy.optimizer.param_groups[0]["params"]
    for parameter in params:
        parameter.grad = torch.ones_like(parameter)
    copy.zero_grad()
    assert all(parameter.grad is None for parameter in params)


@pytest.mark.parametrize("kind", [list, tuple])
def test_a_batch_on_its_device_comes_back_as_it_is(kind: type) -> None:
    """As ``Tensor.to`` returns the tensor itself; a batch to move gets a new container of the same kind."""
    batch = kind([torch.ones(2), torch.zeros(3)])
    assert send_to_device(batch, torch.device("cpu")) is batch
    moved = send_to_device(batch, torch.device("meta"))
    assert type(moved) is kind and moved is not batch
    assert [t.device.type for t in moved] == ["meta", "meta"]
    assert [t.device.type for t in batch] == ["cpu", "cpu"]


def test_a_batch_with_a_non_tensor_is_rebuilt() -> None:
    batch = [torch.ones(2), "label"]
    moved = send_to_device(batch, torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1] == "label"
    assert send_to_device(batch, torch.device("cpu")) == batch
