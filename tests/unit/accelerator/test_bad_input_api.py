"""Accelerator API misuse (issue 23): done as Accelerate does where it has a meaning, else refused with the fix."""

from __future__ import annotations

import os
from pathlib import Path

import accelerate
import pytest
import torch
from torch import nn

import lightning_accel
from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from tests.helpers import reset_accelerator_states


def _prepare_twice_and_save(library: object, folder: Path) -> tuple[bool, list[str]]:
    accelerator = library.Accelerator(cpu=True)  # type: ignore[attr-defined]
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first, optimizer = accelerator.prepare(model, optimizer)
    second = accelerator.prepare(model)
    same = first is second and accelerator.prepare(first) is first
    accelerator.save_state(folder)
    reset_accelerator_states()
    return same, sorted(os.listdir(folder))


def test_prepare_of_a_prepared_module_returns_its_wrapper_and_save_state_writes_one_model(tmp_path: Path) -> None:
    """HF accelerate 1.15 returns the module it marked as prepared; in one process that is the module itself."""
    ours = _prepare_twice_and_save(lightning_accel, tmp_path / "ours")
    theirs = _prepare_twice_and_save(accelerate, tmp_path / "theirs")
    files = ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert ours == (True, [MANIFEST_NAME, *files])  # ours adds the manifest (lightning_accel.checkpoint.manifest)
    assert theirs == (True, files)


def test_the_reprepared_model_trains_once_per_step() -> None:
    accelerator = lightning_accel.Accelerator(cpu=True)
    model = nn.Linear(3, 1, bias=False)
    prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert accelerator.prepare(model) is prepared
    before = model.weight.detach().clone()
    x = torch.ones(2, 3)
    accelerator.backward(prepared(x).sum())
    optimizer.step()
    torch.testing.assert_close(model.weight, before - 2.0)  # d(sum)/dw = 2 per weight, one step of lr 1


def test_backward_before_prepare_is_refused() -> None:
    """HF accelerate 1.15 runs ``loss.backward()`` (scaled under fp16) as if nothing were missing."""
    accelerator = lightning_accel.Accelerator(cpu=True)
    model = nn.Linear(3, 1)
    with pytest.raises(RuntimeError, match=r"backward was called before any model was prepared.*accelerator\.prepare"):
        accelerator.backward(model(torch.ones(2, 3)).sum())
    assert model.weight.grad is None


def test_accumulate_an_unprepared_model_is_refused_in_one_process() -> None:
    """HF accelerate 1.15 accepts any module (its no_sync is a no-op without DDP), so on several processes a model
    that was never prepared silently synchronises every micro-step. The original module of a prepared model is
    accepted here (HF: in one process, ``prepare`` returns that very module)."""
    accelerator = lightning_accel.Accelerator(cpu=True, gradient_accumulation_steps=2)
    stray = nn.Linear(3, 1)
    refused = (
        r"accumulate\(\) got a Linear that Accelerator\.prepare has not set up.*model = accelerator\.prepare\(model\)"
    )
    with pytest.raises(TypeError, match=refused), accelerator.accumulate(stray):
        pass
    model = nn.Linear(3, 1)
    prepared = accelerator.prepare(model)
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(prepared(torch.ones(1, 3)).sum())
        with accelerator.accumulate(prepared):
            pass
