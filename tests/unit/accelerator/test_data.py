"""Data-loader configurations: the same batches, weights and gathered metrics as HF accelerate, and clear errors.

``tests/scripts/accelerator_data.py`` runs every configuration under both frameworks in one launch per process count
(1 and 2 CPU processes); the single-process tests below compare the sharding classes with Accelerate's directly and
check the errors.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.config import DataLoaderConfiguration
from lightning_accel.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    prepare_data_loader,
)
from tests.helpers import SCRIPTS, load_rank_results, run_python, torchrun

Results = dict[str, list[dict[str, Any]]]
HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None


# ---- differential: one launch per process count --------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp(f"accelerator_data_{request.param}")
    if request.param == 1:
        run_python([str(SCRIPTS / "accelerator_data.py"), "--out", str(out)], timeout=300)
    else:
        torchrun("accelerator_data.py", "--out", str(out), timeout=420)
    found = load_rank_results(out)
    assert {len(ranks) for ranks in found.values()} == {request.param}
    return found


def _cases(results: Results) -> Iterator[tuple[int, str, dict[str, Any], dict[str, Any]]]:
    for rank, (ours, hf) in enumerate(zip(results["ours"], results["hf"], strict=True)):
        assert ours.keys() == hf.keys()
        for case in hf:
            yield rank, case, ours[case], hf[case]


@pytest.mark.launch
def test_same_batches_on_every_process(results: Results) -> None:
    for rank, case, ours, hf in _cases(results):
        for key in ("batches", "ends", "remainders", "length"):
            assert ours[key] == hf[key], f"rank {rank}, {case}: {key}"
        assert all(flags[-1] and not any(flags[:-1]) for flags in ours["ends"] if flags), case


@pytest.mark.launch
def test_same_loader_classes(results: Results) -> None:
    for _, case, ours, hf in _cases(results):
        assert ours["type"] == hf["type"], case
    dispatched = {case for _, case, ours, _ in _cases(results) if ours["type"] == "DataLoaderDispatcher"}
    assert dispatched == {case for case in results["hf"][0] if "dispatch" in case}


@pytest.mark.launch
def test_same_weights_after_training(results: Results) -> None:
    trained = set()
    for _, case, ours, hf in _cases(results):
        assert ("weights" in ours) == ("weights" in hf), case
        if "weights" in hf:
            trained.add(case)
            for key, value in hf["weights"].items():
                torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=0, msg=f"{case}: {key}")
    assert {"split", "uneven_same_count", "custom_batch_sampler", "iterable_shard", "map_dispatch_shuffled"} <= trained


@pytest.mark.launch
def test_gather_for_metrics_counts(results: Results) -> None:
    for _, case, ours, hf in _cases(results):
        assert ours.get("gathered") == hf.get("gathered"), case
    first = results["ours"][0]
    # The padding is dropped through the remainder (map-style, dispatch), kept where Accelerate keeps it (iterable
    # datasets sharded without dispatch).
    expected = {"split": 22, "uneven_same_count": 23, "iterable_dispatch_padded": 21, "map_dispatch_shuffled": 23}
    for case, count in expected.items():
        assert len(first[case]["gathered"]) == count, case
        assert sorted(first[case]["gathered"]) == list(range(count)), case
    if len(results["ours"]) == 2:
        assert len(first["iterable_shard"]["gathered"]) == 24


@pytest.mark.launch
def test_even_batches_false_gives_fewer_batches_to_some_processes(results: Results) -> None:
    if len(results["ours"]) == 1:
        pytest.skip("needs two processes")
    counts = [len(rank["uneven_fewer_batches"]["batches"][0]) for rank in results["ours"]]
    assert counts == [4, 3]
    seen = sorted(i for rank in results["ours"] for batch in rank["uneven_fewer_batches"]["batches"][0] for i in batch)
    assert seen == list(range(20))  # nothing repeated, nothing lost


@pytest.mark.launch
def test_join_uneven_inputs_matches_a_plain_pytorch_replay(results: Results) -> None:
    """Processes run out at different steps; under join the ones left average with the joined ones' zeros."""
    from tests.scripts.accelerator_data import sample

    runs = results["join"]
    world = len(runs)
    torch.manual_seed(7)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(max(len(run["batches"]) for run in runs)):
        optimizer.zero_grad()
        for run in runs:
            if step < len(run["batches"]):
                _, x, y = (torch.stack(t) for t in zip(*(sample(i) for i in run["batches"][step]), strict=True))
                (nn.functional.mse_loss(model(x), y) / world).backward()  # DDP divides by the initial world size
        optimizer.step()
    if world == 2:
        assert [len(run["batches"]) for run in runs] == [4, 3]
    for run in runs:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(run["weights"][key], value, msg=key)


@pytest.mark.launch
@pytest.mark.skipif(not HAS_TORCHDATA, reason="torchdata is not installed")
def test_stateful_loader_resumes_like_accelerate(results: Results) -> None:
    for rank, case, ours, hf in _cases(results):
        if case == "stateful":
            assert ours["resume"] == hf["resume"], rank
            assert ours["resume"]["num_yielded"] == 3 and ours["resume"]["rest"]


# ---- sharding classes against Accelerate's, on one process -------------------------------------------------------


class _Chunks:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def test_batch_sampler_shard_deals_like_accelerate() -> None:
    import accelerate.data_loader as hf

    grid = itertools.product(range(0, 15), [1, 2, 3], [1, 2, 3], [False, True], [False, True], [False, True])
    for n, size, procs, drop_last, split, even in grid:
        if split and (size % procs or size < procs):
            continue
        sampler = BatchSampler(SequentialSampler(range(n)), size, drop_last)
        for rank in range(procs):
            ours = BatchSamplerShard(sampler, procs, rank, split, even)
            theirs = hf.BatchSamplerShard(sampler, procs, rank, split, even)
            assert list(ours) == list(theirs), (n, size, procs, drop_last, split, even, rank)
            assert len(ours) == len(theirs)


def test_batch_sampler_shard_deals_custom_batches_like_accelerate() -> None:
    import accelerate.data_loader as hf

    for sizes, procs, even in itertools.product(([3, 1, 2], [1], [2, 2, 2, 2, 5], [4, 1, 1, 3, 2]), (2, 3), (1, 0)):
        for rank in range(procs):
            ours = list(BatchSamplerShard(_Chunks(sizes), procs, rank, even_batches=bool(even)))
            assert ours == list(hf.BatchSamplerShard(_Chunks(sizes), procs, rank, even_batches=bool(even)))


def test_iterable_dataset_shard_like_accelerate() -> None:
    import accelerate.data_loader as hf

    for n, size, procs, drop_last, split in itertools.product(range(0, 15), [1, 2, 4], [1, 2, 3], [0, 1], [0, 1]):
        if split and size % procs:
            continue
        for rank in range(procs):
            ours = IterableDatasetShard(_Stream(n), size, bool(drop_last), procs, rank, bool(split))
            theirs = hf.IterableDatasetShard(_Stream(n), size, bool(drop_last), procs, rank, bool(split))
            theirs.set_epoch(0)
            assert list(ours) == list(theirs), (n, size, procs, drop_last, split, rank)
            assert len(ours) == len(theirs)


# ---- errors and single-process behaviour ------------------------------------------------------------------------


def _loader(**kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(12.0)), **kwargs)


def _prepare(loader: DataLoader, device: torch.device | None = None, **kwargs: Any) -> DataLoaderShard:
    return prepare_data_loader(loader, device, num_processes=2, process_index=0, **kwargs)


def test_split_batches_needs_a_batch_size_the_processes_divide() -> None:
    with pytest.raises(ValueError, match=r"multiple of 2; got batch_size=3"):
        _prepare(_loader(batch_size=3), split_batches=True)
    with pytest.raises(ValueError, match="needs the batch size"):
        _prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_sampler=_Chunks([2, 2, 2])), split_batches=True)
    with pytest.raises(ValueError, match=r"multiple of 2; got batch_size=5"):
        IterableDatasetShard(_Stream(4), batch_size=5, num_processes=2, split_batches=True)
    assert [len(b[0]) for b in _prepare(_loader(batch_size=4), split_batches=True)] == [2, 2, 2]


def test_dispatch_batches_needs_device_placement() -> None:
    with pytest.raises(ValueError, match=r"dispatch_batches=True .* needs device placement"):
        _prepare(_loader(batch_size=2), dispatch_batches=True)
    # The default (None) dispatches iterable datasets only when batches are placed.
    assert type(_prepare(DataLoader(_Stream(8), batch_size=2))) is DataLoaderShard
    assert type(_prepare(DataLoader(_Stream(8), batch_size=2), torch.device("cpu"))) is DataLoaderDispatcher


def test_unshardable_loaders_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"IterableDataset .* needs its batch_size"):
        _prepare(DataLoader(_Stream(8), batch_size=None), dispatch_batches=False)
    with pytest.raises(ValueError, match="batch_size=None"):
        _prepare(_loader(batch_size=None))


def test_dispatch_of_batches_that_do_not_concatenate_raises() -> None:
    ragged = [torch.zeros(1, 2), torch.zeros(1, 3)]
    loader = DataLoaderDispatcher(ragged, batch_size=None, device=torch.device("cpu"), num_processes=2, process_index=0)
    with pytest.raises(RuntimeError, match="dispatch_batches=False"):
        list(loader)


def test_stateful_loader_without_torchdata_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match=r"lightning-accel\[stateful\]"):
        _prepare(_loader(batch_size=2), use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    with pytest.raises(ImportError, match=r"torchdata>=0\.8"):
        accelerator.prepare(_loader(batch_size=2))


@pytest.mark.skipif(not HAS_TORCHDATA, reason="torchdata is not installed")
def test_stateful_loader_state_dict_resumes_mid_epoch() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = accelerator.prepare(_loader(batch_size=2))
    batches = iter(loader)
    assert [next(batches)[0].tolist() for _ in range(2)] == [[0.0, 1.0], [2.0, 3.0]]
    state = loader.state_dict()
    assert state["_num_yielded"] == 2
    del batches
    loader.load_state_dict(state)
    assert [b[0].tolist() for b in loader] == [[4.0, 5.0], [6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
    assert loader.state_dict()["_iterator_finished"] is True


def test_plain_loader_state_dict_is_its_position() -> None:
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(_loader(batch_size=4))
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert state == {"iteration": 0, "position": 1}
    del batches
    loader.load_state_dict(state)
    assert [b[0].tolist() for b in loader] == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]


class _Sharded(IterableDataset):
    """Stands for a Hugging Face ``datasets.IterableDataset`` made of shards."""

    def __init__(self, shards: list[list[int]]) -> None:
        self.shards = shards

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    def shard(self, num_shards: int, index: int) -> _Sharded:
        return _Sharded(self.shards[index::num_shards])

    def __iter__(self) -> Iterator[int]:
        return (i for shard in self.shards for i in shard)


def test_hf_streaming_datasets_are_split_by_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(IterableDataset=_Sharded))
    loader = DataLoader(_Sharded([[0, 1, 2], [3, 4], [5, 6, 7]]), batch_size=2)
    shard = prepare_data_loader(loader, None, num_processes=2, process_index=1)
    assert [b.tolist() for b in shard] == [[3, 4]]
    assert [b.tolist() for b in _prepare(loader)] == [[0, 1], [2, 5], [6, 7]]
    # Too few shards, or split batches: dealt sample by sample.
    few = DataLoader(_Sharded([[0, 1, 2, 3]]), batch_size=1)
    assert [b.tolist() for b in _prepare(few)] == [[0], [2]]
    assert [b.tolist() for b in _prepare(loader, split_batches=True)] == [[0], [2], [4], [6]]


def test_iterable_dataset_dispatched_on_one_process() -> None:
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(_Stream(5), batch_size=2))
    assert isinstance(loader, DataLoaderDispatcher)
    seen = []
    for batch in loader:
        seen.append((batch.tolist(), accelerator.gradient_state.end_of_dataloader))
    assert seen == [([0, 1], False), ([2, 3], False), ([4], True)]
    assert accelerator.prepare_data_loader(loader) is loader  # prepared already: returned as it is
