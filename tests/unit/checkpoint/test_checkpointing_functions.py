"""``lightning_accel.checkpointing``'s Accelerate functions against HF accelerate's on the same states.

``save_accelerator_state`` writes the file names and contents HF's writes (weights as safetensors or ``torch.save``,
optimizer, scheduler, stateful loader, scaler, RNG states); ``load_accelerator_state`` of each library reads the other's
files back into fresh objects, restores the generators and returns the same attributes; ``save_custom_state`` /
``load_custom_state`` likewise. One process (the 2-process ``save_state`` checks are in test_accelerator_sharded_ckpt).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate.checkpointing as hf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_accel import checkpointing as ours


@pytest.fixture(autouse=True)
def hf_partial_state() -> None:
    from accelerate.state import PartialState

    PartialState(cpu=True)  # HF's functions log and save through it


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: safetensors keeps one of the two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


class StatefulLoader:
    """What the functions read from a loader prepared with ``use_stateful_dataloader``."""

    use_stateful_dataloader = True

    def __init__(self, position: int) -> None:
        self.position = position
        self.dataset = list(range(8))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def trained(seed: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (seed % 5 + 3))
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]])).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    loaders = [torch.utils.data.DataLoader(list(range(4))), StatefulLoader(position=seed + 3)]
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, loaders=loaders)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _save(library: Any, run: SimpleNamespace, folder: Path, safe: bool, step: int = 7) -> Path:
    folder.mkdir()
    _seed_all(11)  # the same generator states in both files
    return library.save_accelerator_state(
        str(folder),
        [run.model.state_dict()],
        [run.optimizer],
        [run.scheduler],
        run.loaders,
        0,
        step,
        scaler=run.scaler,
        safe_serialization=safe,
    )


def _same(mine: Any, theirs: Any, where: str = "") -> None:
    assert type(mine) is type(theirs), where
    if isinstance(mine, dict):
        assert list(mine) == list(theirs), where
        for key in mine:
            _same(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(mine, torch.Tensor):
        assert torch.equal(mine, theirs), where
    elif isinstance(mine, np.ndarray):
        assert np.array_equal(mine, theirs), where
    else:
        assert mine == theirs, where


def _read(path: Path) -> Any:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=False)


def test_signatures_are_accelerates() -> None:
    for name in ("save_accelerator_state", "load_accelerator_state", "save_custom_state", "load_custom_state"):
        mine = inspect.signature(getattr(ours, name)).parameters.values()
        theirs = inspect.signature(getattr(hf, name)).parameters.values()
        assert [(p.name, p.default, p.kind) for p in mine] == [(p.name, p.default, p.kind) for p in theirs], name


@pytest.mark.parametrize("safe", [True, False])
def test_save_accelerator_state_writes_hf_files(tmp_path: Path, safe: bool) -> None:
    run = trained(seed=0)
    mine, theirs = _save(ours, run, tmp_path / "ours", safe), _save(hf, run, tmp_path / "hf", safe)
    assert mine == tmp_path / "ours" and theirs == tmp_path / "hf"
    names = sorted(p.name for p in mine.iterdir())
    assert names == sorted(p.name for p in theirs.iterdir())
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    assert names == sorted(
        [weights, "optimizer.bin", "scheduler.bin", "scaler.pt", "dl_state_dict_1.bin", "random_states_0.pkl"]
    )
    for name in names:
        _same(_read(mine / name), _read(theirs / name), name)
    if safe:
        assert "head.weight" not in load_file(mine / weights)  # the tied alias left out, as HF does


def _restore(library: Any, folder: Path, **kwargs: Any) -> tuple[SimpleNamespace, dict[str, Any], torch.Tensor]:
    fresh = trained(seed=3)
    _seed_all(99)
    result = library.load_accelerator_state(
        str(folder),
        [fresh.model],
        [fresh.optimizer],
        [fresh.scheduler],
        fresh.loaders,
        0,
        scaler=fresh.scaler,
        **kwargs,
    )
    return fresh, result, torch.rand(3)  # drawn from the restored generator


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize(("writer", "reader"), [(hf, ours), (ours, hf), (ours, ours)])
def test_load_accelerator_state_reads_either_library(tmp_path: Path, safe: bool, writer: Any, reader: Any) -> None:
    run = trained(seed=0)
    _save(writer, run, tmp_path / "ckpt", safe)
    _seed_all(11)
    expected_draw = torch.rand(3)
    fresh, result, draw = _restore(reader, tmp_path / "ckpt")
    assert result == {"step": 7}
    assert torch.equal(draw, expected_draw)
    _same(fresh.model.state_dict(), run.model.state_dict())
    assert fresh.model.head.weight is fresh.model.embed.weight
    _same(fresh.optimizer.state_dict(), run.optimizer.state_dict())
    _same(fresh.scheduler.state_dict(), run.scheduler.state_dict())
    _same(fresh.scaler.state_dict(), run.scaler.state_dict())
    assert fresh.loaders[1].position == run.loaders[1].position


def test_load_options_as_hf(tmp_path: Path) -> None:
    run = trained(seed=0)
    _save(hf, run, tmp_path / "ckpt", safe=True)
    for library in (ours, hf):
        with pytest.raises(TypeError, match="Unsupported optimizer map location"):
            _restore(library, tmp_path / "ckpt", map_location="cuda:3")
        fresh, _, _ = _restore(library, tmp_path / "ckpt", map_location="on_device")
        assert fresh.optimizer.state_dict()["state"][0]["exp_avg"].device.type == "cpu"
        _restore(library, tmp_path / "ckpt", load_kwargs={"weights_only": True})


def test_model_keys_must_match_unless_load_state_dict_is_told(tmp_path: Path) -> None:
    run = trained(seed=0)
    _save(hf, run, tmp_path / "ckpt", safe=False)

    class Wider(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    def load(library: Any, **kwargs: Any) -> Any:
        return library.load_accelerator_state(str(tmp_path / "ckpt"), [Wider()], [], [], [], 0, **kwargs)

    with pytest.raises(ValueError, match=r"does not match model 0: missing or unexpected \['extra.bias'"):
        load(ours)
    with pytest.raises(RuntimeError, match="Missing key"):  # HF: load_state_dict's own error
        load(hf)
    assert load(ours, strict=False) == load(hf, strict=False) == {"step": 7}


def test_missing_random_states_warn(tmp_path: Path) -> None:
    run = trained(seed=0)
    _save(ours, run, tmp_path / "ckpt", safe=True)
    (tmp_path / "ckpt" / "random_states_0.pkl").unlink()
    with pytest.warns(UserWarning, match="random_states_0.pkl is missing"):
        _, result, _ = _restore(ours, tmp_path / "ckpt")
    assert result == {} == _restore(hf, tmp_path / "ckpt")[1]


class Counter:
    def __init__(self, count: int) -> None:
        self.count = count
        self.history = [np.arange(count, dtype=np.uint32)]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.history = state["count"], state["history"]


def test_custom_state_as_hf(tmp_path: Path) -> None:
    for index in (0, 3):
        for library, folder in ((ours, tmp_path / "ours"), (hf, tmp_path / "hf")):
            folder.mkdir(exist_ok=True)
            library.save_custom_state(Counter(5 + index), str(folder), index=index)
        name = f"custom_checkpoint_{index}.pkl"
        assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(
            p.name for p in (tmp_path / "hf").iterdir()
        )
        _same(_read(tmp_path / "ours" / name), _read(tmp_path / "hf" / name))
        for reader, folder in ((ours, tmp_path / "hf"), (hf, tmp_path / "ours")):
            restored = Counter(0)
            reader.load_custom_state(restored, str(folder), index)
            assert restored.count == 5 + index
            assert np.array_equal(restored.history[0], np.arange(5 + index))
    with pytest.raises(ValueError, match=r"custom_checkpoint_9\.pkl"):
        ours.load_custom_state(Counter(0), str(tmp_path / "ours"), 9)
    (tmp_path / "node").mkdir()
    ours.save_custom_state(Counter(1), str(tmp_path / "node"), save_on_each_node=True)
    assert (tmp_path / "node" / "custom_checkpoint_0.pkl").is_file()


class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class SamplerLoader:
    """A loader over an ``IterableDatasetShard`` with a seedable sampler: what Accelerate saves as ``sampler.bin``."""

    def __init__(self, library: Any, epoch: int) -> None:
        self.dataset = library.IterableDatasetShard(Numbers())
        self.sampler = library.SeedableRandomSampler(range(4), data_seed=3)
        self.sampler.set_epoch(epoch)

    def get_sampler(self) -> Any:
        return self.sampler

    def set_sampler(self, sampler: Any) -> None:
        self.sampler = sampler


def test_seedable_sampler_of_an_iterable_shard_as_hf(tmp_path: Path) -> None:
    import accelerate.data_loader as hf_loaders

    import lightning_accel.data_loader as our_loaders

    for library, loaders, folder in ((ours, our_loaders, tmp_path / "ours"), (hf, hf_loaders, tmp_path / "hf")):
        folder.mkdir()
        library.save_accelerator_state(str(folder), [], [], [], [SamplerLoader(loaders, epoch=5)], 0, 1)
        saved = torch.load(folder / "sampler.bin", weights_only=False)
        assert (type(saved).__name__, saved.epoch) == ("SeedableRandomSampler", 5)
    fresh = SamplerLoader(our_loaders, epoch=0)
    ours.load_accelerator_state(str(tmp_path / "ours"), [], [], [], [fresh], 0)
    assert fresh.sampler.epoch == 5
