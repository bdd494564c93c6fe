"""Loads below the shim are weights-only: a planted pickle runs nothing without the opt-in, and the refusal names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from lightning_accel.checkpoint.state_files import load_custom_file, load_samplers


class _Planted:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_touch, (str(self.marker),))


def _touch(path: str) -> dict[str, int]:
    Path(path).touch()
    return {"count": 1}


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def test_planted_custom_checkpoint_refused_naming_file_and_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save(_Planted(marker), tmp_path / "custom_checkpoint_0.pkl")
    with pytest.raises(ValueError, match=r"custom_checkpoint_0\.pkl.*weights_only=False"):
        load_custom_file(_Counter(), tmp_path, 0)
    assert not marker.exists()
    with pytest.warns(UserWarning, match=r"custom_checkpoint_0\.pkl"):
        load_custom_file(_Counter(), tmp_path, 0, weights_only=False)
    assert marker.exists()  # the opt-in unpickles in full


def test_plain_custom_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    torch.save({"count": 7}, tmp_path / "custom_checkpoint_0.pkl")
    counter = _Counter()
    load_custom_file(counter, tmp_path, 0)
    assert counter.count == 7


def test_planted_sampler_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save(_Planted(marker), tmp_path / "sampler.bin")
    loader = DataLoader(TensorDataset(torch.arange(4.0)), sampler=RandomSampler(range(4)))
    with pytest.raises(ValueError, match=r"sampler\.bin.*weights_only=False"):
        load_samplers([loader], tmp_path, lambda _: loader.sampler)
    assert not marker.exists()


def test_hf_accelerate_folder_loads(tmp_path: Path) -> None:
    """A folder HF accelerate 1.15's save_state wrote loads weights-only; its sampler file as HF's save writes it."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import save as hf_save

    hf = accelerate.Accelerator(cpu=True)
    counter = _Counter()
    counter.count = 3
    hf.register_for_checkpointing(counter)
    folder = tmp_path / "ckpt"
    hf.save_state(str(folder))
    restored = _Counter()
    load_custom_file(restored, folder, 0)
    assert restored.count == 3
    dataset = TensorDataset(torch.arange(8.0))
    written = SeedableRandomSampler(dataset, generator=torch.Generator().manual_seed(5))
    hf_save(written, folder / "sampler.bin", safe_serialization=False)  # what HF's save_state does for a sampler
    target = DataLoader(dataset, sampler=RandomSampler(dataset))
    load_samplers([target], folder, lambda _: target.sampler)
    restored_sampler = target.batch_sampler.sampler  # where a plain loader's batch sampler holds it
    assert isinstance(restored_sampler, SeedableRandomSampler)
    assert list(restored_sampler) == list(written)
