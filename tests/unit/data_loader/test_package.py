"""``lightning_accel.data_loader`` is a package: its public loader classes live in public modules, old paths work."""

from __future__ import annotations

import traceback
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel
import lightning_accel.data_loader as data_loader


@pytest.mark.parametrize("name", data_loader.__all__)
def test_every_public_name_is_defined_in_a_public_module(name: str) -> None:
    obj = getattr(data_loader, name)
    module = obj.__module__
    assert module.startswith("lightning_accel.data_loader")
    assert not any(part.startswith("_") for part in module.split("."))


def test_the_package_level_paths_keep_working() -> None:
    from lightning_accel.data_loader import BatchSamplerShard, DataLoaderShard, IterableDatasetShard, SkipDataLoader

    assert lightning_accel.skip_first_batches is data_loader.skip_first_batches
    assert {BatchSamplerShard, DataLoaderShard, IterableDatasetShard, SkipDataLoader} <= {
        getattr(data_loader, name) for name in data_loader.__all__
    }


class _NoSize(torch.utils.data.Sampler[list[int]]):
    def __iter__(self) -> Iterator[list[int]]:
        yield [0]


def test_a_loader_error_traceback_names_the_public_module() -> None:
    loader = data_loader.DataLoaderShard(TensorDataset(torch.arange(4.0)), batch_sampler=_NoSize())
    with pytest.raises(TypeError, match="_NoSize has no batch_size") as caught:
        _ = loader.total_batch_size
    files = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert any(f.endswith("lightning_accel/data_loader/loaders.py") for f in files), files
    assert not any("_accelerator" in f for f in files), files


def test_prepared_loaders_are_the_public_class() -> None:
    accelerator = lightning_accel.Accelerator(cpu=True)
    prepared = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    assert type(prepared) is data_loader.DataLoaderShard
    assert [batch[0].tolist() for batch in prepared] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
