"""Data loaders prepared by the ``Accelerator``: sharded across processes, epoch-aware, end-of-loader aware.

The order of samples is Accelerate 1.15's for every :class:`~lightning_accel.config.DataLoaderConfiguration`, so the
same script draws the same batches under Accelerate and here:

- map-style datasets (any batch sampler) are dealt by :class:`BatchSamplerShard`; iterable datasets by
  :class:`IterableDatasetShard` (both in :mod:`lightning_accel._data_sharding`);
- with ``dispatch_batches`` (the default for iterable datasets when batches are placed on the device), only process
  0 iterates the loader and :class:`DataLoaderDispatcher` broadcasts each batch for the processes to slice;
- with ``use_stateful_dataloader`` the batches come from torchdata's ``StatefulDataLoader`` and the loader's
  ``state_dict()`` is the one to resume from.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from typing_extensions import override

from lightning_accel._data_loaders import DataLoaderDispatcher, DataLoaderShard, stateful_dataloader_class
from lightning_accel._data_sharding import BatchSamplerShard, IterableDatasetShard, check_split_batch_size

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]

# DataLoader arguments carried over to the prepared loader (the sampling ones are rebuilt).
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context")
_WORKER_ONLY = ("prefetch_factor", "persistent_workers")
_RNG_TYPES = ("generator", "torch")


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose epoch ``e`` draws its permutation from the seed ``data_seed + e``.

    Args:
        *args: ``RandomSampler`` arguments.
        data_seed: Seed of epoch 0; ``None`` uses ``torch.random.initial_seed()``.
        **kwargs: ``RandomSampler`` keyword arguments.

    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    @override
    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (hence the seed) of the next iteration."""
        self.epoch = epoch


def check_rng_types(rng_types: Sequence[Any]) -> list[str]:
    """Normalise ``rng_types`` (strings or ``RNGType``) to strings.

    Raises:
        ValueError: For a type this package does not synchronise.

    """
    names = [str(getattr(t, "value", t)) for t in rng_types]
    unknown = [n for n in names if n not in _RNG_TYPES]
    if unknown:
        raise ValueError(f"rng_types {unknown} are not supported; use a subset of {list(_RNG_TYPES)}.")
    return names


def get_sampler(dataloader: DataLoader) -> Any:
    """The index sampler below the loader's batch sampler (``None`` when it has none)."""
    if isinstance(dataloader.sampler, (BatchSampler, BatchSamplerShard)):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None,
    *,
    num_processes: int,
    process_index: int,
    split_batches: bool = False,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    rng_types: Sequence[str] = ("generator",),
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
) -> DataLoaderShard:
    """Rebuild ``dataloader`` for this process, as Accelerate's ``prepare_data_loader`` does.

    Args:
        dataloader: The user's loader.
        device: Where batches go; ``None`` leaves them where they are (and turns the ``dispatch_batches=None``
            default off).
        num_processes: Number of processes.
        process_index: This process's rank.
        split_batches: Split each batch between the processes instead of giving each its own batches.
        dispatch_batches: Process 0 reads and the others receive; ``None`` means "for iterable datasets" (when
            ``device`` is set).
        even_batches: Pad the last round so that every process gets as many batches.
        rng_types: Generators synchronised at each iteration.
        use_seedable_sampler: Replace a ``RandomSampler`` by a :class:`SeedableRandomSampler`.
        data_seed: Seed of the seedable sampler.
        non_blocking: Non-blocking host-to-device copies.
        use_stateful_dataloader: Back the loader with torchdata's ``StatefulDataLoader``.
        slice_fn_for_dispatch: How a dispatched batch is sliced.

    Raises:
        ValueError: For ``dispatch_batches=True`` without a device, or ``split_batches`` with a batch size that the
            number of processes does not divide.
        ImportError: For ``use_stateful_dataloader`` without torchdata.

    """
    if dispatch_batches is None:
        dispatch_batches = device is not None and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and device is None:
        raise ValueError(
            "dispatch_batches=True sends the batches from process 0 to the device of each process, so it needs device"
            " placement: pass device_placement=True (the default) or leave dispatch_batches unset."
        )
    if split_batches:
        batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
        check_split_batch_size(batch_size, num_processes, "the DataLoader")
    if use_stateful_dataloader:
        stateful_dataloader_class()
    sampler = get_sampler(dataloader)
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
            data_seed=data_seed,
        )
    common: dict[str, Any] = {name: getattr(dataloader, name) for name in _CARRIED}
    if dataloader.num_workers > 0:
        common.update({name: getattr(dataloader, name) for name in _WORKER_ONLY})
    common.update(
        device=device,
        non_blocking=non_blocking,
        source_drop_last=dataloader.drop_last,
        use_stateful_dataloader=use_stateful_dataloader,
    )
    if dispatch_batches:
        return DataLoaderDispatcher(
            dataloader.dataset,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
            slice_fn=slice_fn_for_dispatch,
            **_sampling(dataloader, sampler),
            **common,
        )
    return _prepare_shard(
        dataloader,
        sampler,
        common,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
        rng_types=rng_types,
        use_seedable_sampler=use_seedable_sampler,
    )


def _prepare_shard(
    dataloader: DataLoader,
    sampler: Any,
    common: dict[str, Any],
    *,
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    rng_types: Sequence[str],
    use_seedable_sampler: bool,
) -> DataLoaderShard:
    """The :class:`DataLoaderShard` of one process (no dispatching)."""
    dataset = dataloader.dataset
    sampling = _sampling(dataloader, sampler)
    synchronized = None
    streaming = _shard_streaming_dataset(dataset, num_processes, process_index, split_batches)
    if streaming is not None:
        dataset = streaming
    elif num_processes > 1 and isinstance(dataset, IterableDataset):
        synchronized = getattr(dataset, "generator", None)
        batch_size = dataloader.batch_size
        if batch_size is None:
            raise ValueError(
                "Sharding a DataLoader over an IterableDataset between processes needs its batch_size (got None):"
                " pass batch_size=..., or DataLoaderConfiguration(dispatch_batches=True)."
            )
        dataset = IterableDatasetShard(
            dataset, batch_size, dataloader.drop_last, num_processes, process_index, split_batches=split_batches
        )
        sampling["batch_size"] = batch_size // num_processes if split_batches else batch_size
    elif num_processes > 1:
        if "batch_sampler" not in sampling and not isinstance(dataloader.sampler, BatchSampler):
            raise ValueError(
                "A DataLoader with batch_size=None (no batch sampler) cannot be sharded between processes: pass"
                " batch_size=..., a batch_sampler=..., or DataLoaderConfiguration(dispatch_batches=True)."
            )
        if not use_seedable_sampler and hasattr(sampler, "generator"):
            if sampler.generator is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                sampler.generator = torch.Generator().manual_seed(seed)
            synchronized = sampler.generator
        key = "sampler" if "sampler" in sampling else "batch_sampler"
        sampling[key] = BatchSamplerShard(sampling[key], num_processes, process_index, split_batches, even_batches)
    return DataLoaderShard(
        dataset,
        generator=dataloader.generator,
        rng_types=[t for t in rng_types if t != "generator" or synchronized is not None],
        synchronized_generator=synchronized,
        **sampling,
        **common,
    )


def _shard_streaming_dataset(dataset: Any, num_processes: int, process_index: int, split_batches: bool) -> Any:
    """A Hugging Face ``datasets.IterableDataset`` with enough shards, split by shards as Accelerate does (or None)."""
    streaming_class = getattr(sys.modules.get("datasets"), "IterableDataset", None)
    if num_processes == 1 or split_batches or streaming_class is None or not isinstance(dataset, streaming_class):
        return None
    if dataset.n_shards < num_processes:
        return None
    return dataset.shard(num_shards=num_processes, index=process_index)


def _sampling(dataloader: DataLoader, sampler: Any) -> dict[str, Any]:
    """The sampling arguments of the prepared loader: the original ones, with ``sampler`` below the batch sampler."""
    if isinstance(dataloader.dataset, IterableDataset):
        return {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
    if isinstance(dataloader.sampler, BatchSampler):  # a batch sampler given as sampler=
        return {"sampler": _with_sampler(dataloader.sampler, sampler), "batch_size": dataloader.batch_size}
    if dataloader.batch_sampler is None:  # batch_size=None: samples, not batches
        return {"sampler": sampler if sampler is not None else dataloader.sampler, "batch_size": None}
    return {"batch_sampler": _with_sampler(dataloader.batch_sampler, sampler)}


def _with_sampler(batch_sampler: Any, sampler: Any) -> Any:
    """``batch_sampler``, or a copy of it drawing from ``sampler`` when that replaces its own (the seedable one)."""
    if sampler is None or getattr(batch_sampler, "sampler", None) is sampler:
        return batch_sampler
    replaced = copy.copy(batch_sampler)
    replaced.sampler = sampler
    return replaced


def skip_first_batches(dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
    """A copy of a prepared loader whose iterations start after ``num_batches`` batches (to resume mid-epoch).

    Raises:
        TypeError: If ``dataloader`` was not prepared by the ``Accelerator``.
        ValueError: If ``num_batches`` is negative.

    """
    if not isinstance(dataloader, DataLoaderShard):
        raise TypeError(
            f"skip_first_batches needs a DataLoader prepared by Accelerator.prepare, got {type(dataloader).__name__}."
        )
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}.")
    skipping = copy.copy(dataloader)
    skipping.skip_batches = num_batches
    dataloader.resume_position = 0  # the copy takes over a position restored by load_state
    return skipping
