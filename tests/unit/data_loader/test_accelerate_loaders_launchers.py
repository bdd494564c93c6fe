"""Accelerate's data-loader classes and launchers in lightning_accel, checked against HF accelerate 1.15.

The skipping and stateful data loaders, and ``debug_launcher`` / ``notebook_launcher`` with real processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import accelerate.data_loader as hf_data_loader
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import lightning_accel
from lightning_accel import utils as ours
from lightning_accel.data_loader import SkipBatchSampler, SkipDataLoader, skip_first_batches
from lightning_accel.state import GradientState, PartialState
from lightning_accel.utils.other import get_free_port
from tests.helpers import REPO, clean_env

# ---- data loaders -------------------------------------------------------------------------------------------------


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield from range(10)


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() if isinstance(batch, torch.Tensor) else list(batch) for batch in loader]


def test_skip_batch_sampler_as_hf() -> None:
    inner = BatchSampler(SequentialSampler(range(16)), batch_size=3, drop_last=False)
    mine, theirs = SkipBatchSampler(inner, 2), hf_data_loader.SkipBatchSampler(inner, 2)
    assert list(mine) == list(theirs) and len(mine) == len(theirs) == 4 and mine.total_length == 6
    assert mine.batch_size == 3 and mine.drop_last is False
    with pytest.raises(ValueError, match="skip_batches"):
        SkipBatchSampler(inner, -1)


@pytest.mark.parametrize("dataset", [list(range(16)), _Stream()], ids=["map-style", "iterable"])
def test_skip_data_loader_as_hf(dataset: Any) -> None:
    mine = SkipDataLoader(dataset, batch_size=4, skip_batches=2)
    theirs = hf_data_loader.SkipDataLoader(dataset, batch_size=4, skip_batches=2)
    assert _batches(mine) == _batches(theirs)
    ends = []
    for _ in mine:
        ends.append(mine.end_of_dataloader)
        assert GradientState().active_dataloader is mine
    assert ends[-1] and not any(ends[:-1])
    assert GradientState().active_dataloader is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(list(range(16)), batch_size=4),
        lambda: DataLoader(list(range(16)), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)),
        lambda: DataLoader(torch.arange(16), batch_size=None, sampler=BatchSampler(range(16), 5, drop_last=True)),
        lambda: DataLoader(_Stream(), batch_size=3),
    ],
    ids=["sequential", "shuffled", "batch sampler as sampler", "iterable"],
)
def test_skip_first_batches_of_plain_loaders_as_hf(make: Any) -> None:
    mine, theirs = skip_first_batches(make(), num_batches=2), hf_data_loader.skip_first_batches(make(), num_batches=2)
    assert type(mine).__name__ == type(theirs).__name__
    assert _batches(mine) == _batches(theirs)


def test_dispatcher_without_a_device_as_hf() -> None:
    from lightning_accel.data_loader import DataLoaderDispatcher

    def collate(rows: list[int]) -> dict[str, Any]:
        return {"x": torch.tensor(rows), "name": "batch"}

    mine = DataLoaderDispatcher(_Stream(), batch_size=4, collate_fn=collate)
    theirs = hf_data_loader.DataLoaderDispatcher(_Stream(), batch_size=4, collate_fn=collate)
    batches, hf_batches = list(mine), list(theirs)
    assert (
        [b["x"].tolist() for b in batches]
        == [b["x"].tolist() for b in hf_batches]
        == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    )
    assert [b["name"] for b in batches] == [b["name"] for b in hf_batches] == ["batch"] * 3


@pytest.mark.launch
def test_stateful_loaders_are_stateful_data_loaders(tmp_path: Path) -> None:
    if importlib.util.find_spec("torchdata") is None:
        pytest.skip("needs torchdata")
    import pickle

    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_accel.data_loader import DataLoaderDispatcher, DataLoaderShard

    loaders = {
        DataLoaderShard: DataLoaderShard(list(range(8)), batch_size=2, use_stateful_dataloader=True),
        DataLoaderDispatcher: DataLoaderDispatcher(list(range(8)), batch_size=2, use_stateful_dataloader=True),
        SkipDataLoader: SkipDataLoader(list(range(8)), batch_size=2, skip_batches=1, use_stateful_dataloader=True),
    }
    for cls, loader in loaders.items():
        assert isinstance(loader, cls) and isinstance(loader, StatefulDataLoader)
        assert type(loader).__name__ == cls.__name__ and isinstance(loader.base_dataloader, StatefulDataLoader)
        plain = cls(list(range(8)), batch_size=2)
        assert not isinstance(plain, StatefulDataLoader) and type(plain.base_dataloader) is DataLoader
        assert pickle.loads(pickle.dumps(type(loader))) is type(loader)
        (tmp_path / f"{cls.__name__}.pkl").write_bytes(pickle.dumps(type(loader)))
    assert _batches(loaders[SkipDataLoader]) == [[2, 3], [4, 5], [6, 7]]
    assert (
        _batches(loaders[DataLoaderShard])
        == _batches(loaders[DataLoaderDispatcher])
        == [[0, 1], [2, 3], [4, 5], [6, 7]]
    )
    code = (  # the variant classes resolve in a new process too (what unpickling a loader needs)
        "import pickle, sys\n"
        "from pathlib import Path\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        "for path in sorted(Path(sys.argv[1]).glob('*.pkl')):\n"
        "    cls = pickle.loads(path.read_bytes())\n"
        "    print(cls.__name__, issubclass(cls, StatefulDataLoader))\n"
    )
    command = [sys.executable, "-c", code, str(tmp_path)]
    out = subprocess.run(command, env=clean_env(), capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["DataLoaderDispatcher True", "DataLoaderShard True", "SkipDataLoader True"]


def test_skip_data_loader_resumes_from_its_stateful_state() -> None:
    if importlib.util.find_spec("torchdata") is None:
        pytest.skip("needs torchdata")
    loader = SkipDataLoader(list(range(20)), batch_size=2, skip_batches=1, use_stateful_dataloader=True)
    seen = []
    for batch in loader:
        seen.append(batch.tolist())
        if len(seen) == 3:
            state = loader.state_dict()
            break
    resumed = SkipDataLoader(list(range(20)), batch_size=2, use_stateful_dataloader=True)
    resumed.load_state_dict(state)
    assert _batches(resumed) == [[8, 9], [10, 11], [12, 13], [14, 15], [16, 17], [18, 19]]
    with pytest.raises(TypeError, match="use_stateful_dataloader=True"):
        SkipDataLoader(list(range(4))).state_dict()


# ---- launchers ----------------------------------------------------------------------------------------------------


def _record_worker(folder: str, offset: int) -> None:
    state = PartialState()
    total = ours.gather(torch.tensor([state.process_index + offset]))
    accelerator = lightning_accel.Accelerator()
    copied = ours.copy_tensor_to_devices(torch.tensor([7, 8, 9], dtype=torch.int32) if state.is_main_process else None)
    line = f"{state.process_index} {state.num_processes} {total.tolist()} {accelerator.distributed_type.value}"
    Path(folder, f"rank{state.process_index}").write_text(f"{line} {copied.tolist()} {copied.dtype}")


def _failing_worker() -> None:
    raise RuntimeError("boom in a worker")


@pytest.mark.launch
def test_debug_launcher_runs_two_cpu_processes(tmp_path: Path) -> None:
    lightning_accel.debug_launcher(_record_worker, args=(str(tmp_path), 10))
    lines = sorted(path.read_text() for path in tmp_path.iterdir())
    assert lines == [
        "0 2 [10, 11] MULTI_CPU [7, 8, 9] torch.int32",
        "1 2 [10, 11] MULTI_CPU [7, 8, 9] torch.int32",
    ]
    assert "ACCELERATE_DEBUG_RDV_FILE" not in os.environ and "WORLD_SIZE" not in os.environ


@pytest.mark.launch
def test_debug_launcher_one_process_and_errors(tmp_path: Path) -> None:
    lightning_accel.debug_launcher(_record_worker, args=(str(tmp_path), 0), num_processes=1)
    assert (tmp_path / "rank0").read_text() == "0 1 [0] NO [7, 8, 9] torch.int32"
    with pytest.raises(Exception, match="boom in a worker"):
        lightning_accel.debug_launcher(_failing_worker)
    with pytest.raises(ValueError, match="num_processes"):
        lightning_accel.debug_launcher(_failing_worker, num_processes=0)


@pytest.mark.launch
def test_notebook_launcher_runs_elastic_workers(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from lightning_accel import Accelerator, notebook_launcher\n"
        "from lightning_accel.utils import gather\n"
        "def train(folder):\n"
        "    accelerator = Accelerator(cpu=True)\n"
        "    ranks = gather(torch.tensor([accelerator.process_index])).tolist()\n"
        "    Path(folder, str(accelerator.process_index)).write_text(f'{ranks} {accelerator.mixed_precision}')\n"
        "if __name__ == '__main__':\n"
        "    notebook_launcher(train, (sys.argv[1],), num_processes=2, use_port=sys.argv[2], mixed_precision='bf16')\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env()
    env["PYTHONPATH"] = str(REPO)
    subprocess.run(
        [sys.executable, str(script), str(out), str(get_free_port())], env=env, check=True, timeout=120, cwd=tmp_path
    )
    assert sorted(path.read_text() for path in out.iterdir()) == ["[0, 1] bf16", "[0, 1] bf16"]


def test_notebook_launcher_checks_arguments() -> None:
    with pytest.raises(ValueError, match="num_processes"):
        lightning_accel.notebook_launcher(_failing_worker)
    with pytest.raises(ValueError, match="node_rank"):
        lightning_accel.notebook_launcher(_failing_worker, num_processes=2, node_rank=1)
    with pytest.raises(ValueError, match="'fp7'"):
        lightning_accel.notebook_launcher(_failing_worker, num_processes=2, mixed_precision="fp7")
    PartialState()
    with pytest.raises(ValueError, match="already has one"):
        lightning_accel.notebook_launcher(_failing_worker, num_processes=2)
    ran: list[int] = []
    lightning_accel.notebook_launcher(lambda: ran.append(1), num_processes=1)
    assert ran == [1]
