"""``loss.backward()`` on a prepared model: allowed where it is correct, refused with a clear error where it is not.

Every gradient and weight is compared with a plain PyTorch loop over the same network and data (the reference), so
a shim that computed the wrong gradients in both of its ``backward`` paths would fail here.
"""

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

INPUTS = torch.linspace(-1, 1, 12).reshape(3, 4)
Result = tuple[list[torch.Tensor], list[torch.Tensor]]  # gradients after backward, weights after one SGD step


@pytest.fixture(autouse=True)
def _clean_environment() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean_env())
    yield
    os.environ.clear()  # DeepSpeed's setup leaves RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK behind
    os.environ.update(saved)


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _copies(tensors: Iterator[torch.Tensor | None]) -> list[torch.Tensor]:
    copies = []
    for tensor in tensors:
        assert tensor is not None
        copies.append(tensor.detach().clone())
    return copies


def _plain_pytorch(mixed_precision: str) -> Result:
    """The reference: no Accelerator; bf16 is CPU autocast around the forward, as Accelerate's is."""
    net = _network()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
        out = net(INPUTS)
    out.float().pow(2).mean().backward()
    grads = _copies(p.grad for p in net.parameters())
    optimizer.step()
    return grads, _copies(iter(net.parameters()))


def _accelerator(mixed_precision: str, plain: bool) -> Result:
    reset_state()
    net = _network()
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loss = model(INPUTS).float().pow(2).mean()
    if plain:
        loss.backward()
    else:
        accelerator.backward(loss)
    grads = _copies(p.grad for p in net.parameters())
    optimizer.step()
    return grads, _copies(iter(net.parameters()))


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for ours, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("plain", [True, False], ids=["loss.backward", "accelerator.backward"])
def test_both_backward_calls_give_plain_pytorchs_gradients_and_step(mixed_precision: str, plain: bool) -> None:
    grads, weights = _plain_pytorch(mixed_precision)
    assert all(g.abs().sum() > 0 for g in grads)
    got_grads, got_weights = _accelerator(mixed_precision, plain)
    _assert_equal(got_grads, grads)
    _assert_equal(got_weights, weights)


def test_the_bf16_reference_differs_from_fp32() -> None:
    """bf16 autocast changes the gradients, so the bf16 case above checks that the shim autocasts."""
    fp32, bf16 = _plain_pytorch("no")[0], _plain_pytorch("bf16")[0]
    assert all(not torch.equal(a, b) for a, b in zip(fp32, bf16, strict=True))


@pytest.mark.usefixtures("process_wide_group")
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
    finally:
        accelerator.end_training()


def _plain_sgd_step_clipped_at_one() -> list[torch.Tensor]:
    """One SGD step of plain PyTorch, clipped at 1.0 (Accelerate's DeepSpeed default, ``gradient_clipping: auto``)."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.linspace(-1, 2, 8).reshape(2, 4)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0) > 1.0  # the clipping matters
    optimizer.step()
    return _copies(iter(net.parameters()))


@pytest.mark.usefixtures("process_wide_group")
def test_a_second_deepspeed_run_in_the_same_process_after_end_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """end_training releases DeepSpeed's cached process groups too (stale ones broke the next engine's setup).

    Each run's accelerator.backward and step give plain PyTorch's weights.
    """
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    expected = _plain_sgd_step_clipped_at_one()
    for _ in range(2):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        reset_state()
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        try:
            accelerator.backward(model(torch.linspace(-1, 2, 8).reshape(2, 4)).float().sum())
            optimizer.step()
            unwrapped = accelerator.unwrap_model(model)
            _assert_equal(_copies(iter(unwrapped.parameters())), expected)
        finally:
            accelerator.end_training()
