"""Accelerate's process state and prepare-time checks in lightning_accel, side by side with HF accelerate 1.15.

Each test runs the same user code on both libraries (each keeps its own shared state) and compares what they answer:
the device ``ACCELERATE_TORCH_DEVICE`` names, ``PartialState`` and ``AcceleratorState`` after a reset, the wording of
``recursively_apply``'s type error, and the refusal to train an 8-bit model with offloaded layers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import accelerate
import accelerate.state as hf_state
import accelerate.utils as hf_utils
import pytest
import torch
from torch import nn

import lightning_accel
import lightning_accel.state as our_state
import lightning_accel.utils as our_utils

LIBRARIES = [
    pytest.param((accelerate, hf_state, hf_utils), id="hf"),
    pytest.param((lightning_accel, our_state, our_utils), id="ours"),
]


@pytest.mark.parametrize("library", LIBRARIES)
def test_accelerate_torch_device_names_the_device(
    library: tuple[ModuleType, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    package, state, _ = library
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:3")
    accelerator = package.Accelerator()
    assert str(accelerator.device) == "cpu:3"
    assert str(state.PartialState().device) == "cpu:3"
    assert accelerator.prepare(nn.Linear(2, 2)).weight.device.type == "cpu"


def test_unusable_torch_device_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="ACCELERATE_TORCH_DEVICE='gpu0'"):
        lightning_accel.Accelerator()


def _after_reset(package: ModuleType, state: ModuleType) -> dict[str, Any]:
    accelerator = package.Accelerator(cpu=True)
    state.AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as error:
        _ = accelerator.num_processes
    return {
        "error_names_reset": "This happens if `AcceleratorState._reset_state()`" in str(error.value),
        "partial_processes": state.PartialState().num_processes,
        "partial_type": str(state.PartialState().distributed_type),
    }


def test_accelerator_state_reset_keeps_the_partial_state_as_hf() -> None:
    ours = _after_reset(lightning_accel, our_state)
    assert ours == _after_reset(accelerate, hf_state)
    assert ours["error_names_reset"] and ours["partial_processes"] == 1


def test_states_describe_the_same_processes_with_their_own_distributed_type() -> None:
    for package, state in ((accelerate, hf_state), (lightning_accel, our_state)):
        package.Accelerator(cpu=True)
        assert state.AcceleratorState().num_processes == state.PartialState().num_processes == 1
        assert state.AcceleratorState().device == state.PartialState().device
        state.AcceleratorState().made_up = "value"
        assert not hasattr(state.PartialState(), "made_up"), package.__name__


def test_recursively_apply_type_error_has_accelerate_wording() -> None:
    messages = []
    for utils in (hf_utils, our_utils):
        with pytest.raises(TypeError) as error:
            utils.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert "<class 'int'>" in messages[1]


def _eight_bit_model(device_map: dict[str, str]) -> nn.Module:
    model = nn.Linear(2, 2)
    model.is_loaded_in_8bit = True  # what transformers sets on a bitsandbytes model
    model.hf_device_map = device_map
    return model


@pytest.mark.parametrize("library", LIBRARIES)
def test_offloaded_8bit_model_is_refused_as_hf(
    library: tuple[ModuleType, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    package = library[0]
    with pytest.raises(ValueError, match="CPU or disk offload"):
        package.Accelerator(cpu=True).prepare_model(_eight_bit_model({"a": "cpu", "b": "disk"}))
    monkeypatch.setattr(f"{package.__name__}.accelerator.is_bitsandbytes_multi_backend_available", lambda: False)
    with pytest.raises(ValueError, match="CPU or disk offload"):
        package.Accelerator(cpu=True).prepare_model(_eight_bit_model({"": "cpu"}))


def test_verify_device_map_agrees_with_hf() -> None:
    for device_map in ({"": "cpu"}, {"a": "cpu", "b": "disk"}, {}):
        model = nn.Linear(2, 2)
        model.hf_device_map = device_map
        ours = lightning_accel.Accelerator(cpu=True).verify_device_map(model)
        assert ours == accelerate.Accelerator(cpu=True).verify_device_map(model) == (len(device_map) > 1)


def _train_fp16_on_cpu(package: ModuleType) -> tuple[str, torch.Tensor]:
    torch.manual_seed(0)
    accelerator = package.Accelerator(cpu=True, mixed_precision="fp16")
    model = nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(data).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return accelerator.mixed_precision, accelerator.unwrap_model(model).weight.detach().clone()


def test_fp16_on_cpu_trains_in_fp32_as_hf_and_says_so() -> None:
    theirs = _train_fp16_on_cpu(accelerate)
    with pytest.warns(UserWarning, match=r"fp16.*needs a GPU.*trains in fp32.*bf16"):
        ours = _train_fp16_on_cpu(lightning_accel)
    assert ours[0] == theirs[0] == "fp16"
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
