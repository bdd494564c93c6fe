"""``loss.backward()`` on a prepared model: allowed where it is correct, refused with a clear error where it is not."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_accel import Accelerator
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.state import reset_state
from tests.helpers import clean_env, free_port


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean_env())
    reset_state()
    yield
    reset_state()
    os.environ.clear()  # DeepSpeed's setup leaves RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK behind
    os.environ.update(saved)


def _gradient(mixed_precision: str, plain: bool) -> torch.Tensor:
    reset_state()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loss = model(torch.linspace(-1, 1, 12).reshape(3, 4)).float().pow(2).mean()
    if plain:
        loss.backward()
    else:
        accelerator.backward(loss)
    return net[0].weight.grad.clone()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_plain_backward_gives_the_accelerator_backward_gradients(mixed_precision: str) -> None:
    expected = _gradient(mixed_precision, plain=False)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(_gradient(mixed_precision, plain=True), expected, rtol=0, atol=0)


def test_plain_backward_is_refused_where_the_engine_runs_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    net = nn.Linear(4, 1)
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        loss = model(torch.ones(2, 4)).float().sum()
        with pytest.raises(RuntimeError, match=r"`accelerator\.backward\(loss\)` instead of `loss\.backward\(\)`"):
            loss.backward()
        accelerator.backward(model(torch.ones(2, 4)).float().sum())  # the supported call still works
    finally:
        accelerator.end_training()


def test_a_second_deepspeed_run_in_the_same_process_after_end_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """end_training releases DeepSpeed's cached process groups too (stale ones broke the next engine's setup)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for _ in range(2):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        reset_state()
        net = nn.Linear(4, 1)
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        try:
            before = net.weight.detach().clone()
            accelerator.backward(model(torch.ones(2, 4)).float().sum())
            optimizer.step()
            assert not torch.equal(accelerator.unwrap_model(model).weight.detach(), before)
        finally:
            accelerator.end_training()
