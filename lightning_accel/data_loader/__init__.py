"""Data loaders prepared by the ``Accelerator``: sharded across processes, epoch-aware, end-of-loader aware.

The order of samples is Accelerate 1.15's for every :class:`~lightning_accel.config.DataLoaderConfiguration`, so the
same script draws the same batches under Accelerate and here:

- map-style datasets (any batch sampler) are dealt by :class:`BatchSamplerShard`; iterable datasets by
  :class:`IterableDatasetShard` (both in :mod:`lightning_accel.data_loader.sharding`; the loader classes are in
  :mod:`lightning_accel.data_loader.loaders`, all importable from here);
- with ``dispatch_batches`` (the default for iterable datasets when batches are placed on the device), only process
  0 iterates the loader and :class:`DataLoaderDispatcher` broadcasts each batch for the processes to slice;
- with ``use_stateful_dataloader`` the batches come from torchdata's ``StatefulDataLoader`` and the loader's
  ``state_dict()`` is the one to resume from.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from typing_extensions import Self, override

from lightning_accel.data_loader.loaders import (
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    register_stateful_base,
    stateful_dataloader_class,
    stateful_variant,
)
from lightning_accel.data_loader.sharding import BatchSamplerShard, IterableDatasetShard, check_split_batch_size
from lightning_accel.state import GradientState, PartialState

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
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
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool | None = None,
    rng_types: Sequence[Any] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoaderShard:
    """Rebuild ``dataloader`` for this process, as Accelerate's ``prepare_data_loader`` does (same arguments).

    Args:
        dataloader: The user's loader.
        device: The device of this process.
        num_processes: Number of processes (default: ``PartialState().num_processes``).
        process_index: This process's rank (default: ``PartialState().process_index``).
        split_batches: Split each batch between the processes instead of giving each its own batches.
        put_on_device: Move the batches to ``device``. ``None`` (the default here) moves them when ``device`` is
            given, which is how the ``Accelerator`` calls it; Accelerate's default is ``False``, so pass it
            explicitly for code that must behave the same under both.
        rng_types: Generators synchronised from process 0 at each iteration (``"generator"``, ``"torch"``);
            ``None``: none.
        dispatch_batches: Process 0 reads and the others receive; ``None`` means "for iterable datasets" when the
            batches are moved to the device.
        even_batches: Pad the last round so that every process gets as many batches.
        slice_fn_for_dispatch: How a dispatched batch is sliced.
        use_seedable_sampler: Replace a ``RandomSampler`` by a :class:`SeedableRandomSampler`.
        data_seed: Seed of the seedable sampler.
        non_blocking: Non-blocking host-to-device copies.
        use_stateful_dataloader: Back the loader with torchdata's ``StatefulDataLoader``.
        torch_device_mesh: Accelerate's tensor/context-parallel mesh; not supported yet (must be ``None``).

    Raises:
        ValueError: For ``dispatch_batches=True`` without device placement, an unknown rng type, or
            ``split_batches`` with a batch size that the number of processes does not divide.
        NotImplementedError: For a ``torch_device_mesh``.
        ImportError: For ``use_stateful_dataloader`` without torchdata.

    """
    if torch_device_mesh is not None:
        raise NotImplementedError(
            "prepare_data_loader(torch_device_mesh=...) shards batches over a tensor/context-parallel mesh, which "
            "lightning_accel's loaders do not do yet; prepare the loader without a mesh"
        )
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    rng_types = check_rng_types(rng_types or ())
    if put_on_device is None:
        put_on_device = device is not None
    device = device if put_on_device else None
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
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


class SkipBatchSampler(BatchSampler):
    """A batch sampler yielding the batches of ``batch_sampler`` after its first ``skip_batches``.

    Args:
        batch_sampler: Any iterable of index lists (a ``BatchSampler``, a :class:`BatchSamplerShard`, ...).
        skip_batches: How many of its first batches to leave out (in every iteration).

    """

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        # BatchSampler.__init__ is not called: the batches, their size and drop_last are batch_sampler's.
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.sampler = getattr(batch_sampler, "sampler", None)  # type: ignore[assignment]  # None: it has none
        self.batch_size = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]  # None: no size
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    @override
    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        """Batches of the wrapped sampler, skipped ones included."""
        return len(self.batch_sampler)

    @override
    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)


@register_stateful_base
class SkipDataLoader(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` whose iterations start after its first ``skip_batches`` batches.

    The batches are drawn from ``base_dataloader``, a ``DataLoader`` (or, with ``use_stateful_dataloader``, torchdata's
    ``StatefulDataLoader``, which this loader then is too) built with the same arguments. It tells
    :class:`~lightning_accel.state.GradientState` when its last batch comes, like the prepared loaders.

    Args:
        dataset: The dataset.
        skip_batches: Batches left out at the start of every iteration.
        use_stateful_dataloader: Draw from a ``StatefulDataLoader``, whose state :meth:`state_dict` returns.
        **kwargs: ``DataLoader`` arguments.

    Raises:
        ValueError: If ``skip_batches`` is negative.
        ImportError: For ``use_stateful_dataloader`` without torchdata.

    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Create the loader; with ``use_stateful_dataloader`` as its :func:`stateful_variant` class."""
        stateful = kwargs.get("use_stateful_dataloader", args[2] if len(args) > 2 else False)
        return super().__new__(stateful_variant(cls) if stateful else cls)

    def __init__(
        self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any
    ) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        loader_class = stateful_dataloader_class() if use_stateful_dataloader else DataLoader
        super().__init__(dataset, **kwargs)
        base: Any = loader_class(dataset, **kwargs)
        self.base_dataloader = base
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.gradient_state = GradientState()
        self._state: dict[str, Any] = base.state_dict() if use_stateful_dataloader else {}

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not a _BaseDataLoaderIter
        self.begin()
        try:
            batches = enumerate(self.base_dataloader)
            current = next(batches, None)
            while current is not None:
                self._snapshot()
                upcoming = next(batches, None)
                self.end_of_dataloader = upcoming is None
                if self.end_of_dataloader:
                    self._snapshot()
                if current[0] >= self.skip_batches:
                    yield current[1]
                current = upcoming
        finally:
            self.end()

    @override
    def __len__(self) -> int:
        return max(len(self.base_dataloader) - self.skip_batches, 0)

    @property
    def total_batch_size(self) -> int | None:
        """Samples per batch (``None`` when the batch sampler has no ``batch_size``)."""
        return self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", None)

    def _snapshot(self) -> None:
        if self.use_stateful_dataloader:
            self._state = self.base_dataloader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The ``StatefulDataLoader``'s state as of the last batch handed out.

        Raises:
            TypeError: Without ``use_stateful_dataloader`` (a plain ``DataLoader`` has no state to resume from).

        """
        self._require_stateful("state_dict")
        return self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the ``StatefulDataLoader`` from a :meth:`state_dict`.

        Raises:
            TypeError: Without ``use_stateful_dataloader``.

        """
        self._require_stateful("load_state_dict")
        self.base_dataloader.load_state_dict(state_dict)
        self._state = state_dict

    def _require_stateful(self, method: str) -> None:
        if not self.use_stateful_dataloader:
            raise TypeError(
                f"SkipDataLoader.{method} needs SkipDataLoader(..., use_stateful_dataloader=True): a plain DataLoader "
                "keeps no state to resume from"
            )


def _plain_loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    """The arguments of a plain ``DataLoader`` that a skipping copy keeps (not those of its sampling)."""
    kwargs: dict[str, Any] = {name: getattr(dataloader, name) for name in (*_CARRIED, "generator")}
    kwargs["pin_memory_device"] = dataloader.pin_memory_device
    kwargs["in_order"] = dataloader.in_order
    if dataloader.num_workers > 0:
        kwargs.update({name: getattr(dataloader, name) for name in _WORKER_ONLY})
    return kwargs


def _skip_plain_loader(dataloader: DataLoader, num_batches: int) -> DataLoader:
    """Accelerate's skipping copy of a loader the ``Accelerator`` did not prepare."""
    kwargs = _plain_loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return SkipDataLoader(
            dataloader.dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    if isinstance(dataloader.sampler, BatchSampler):  # the batch sampler passed as `sampler`, batch_size=None
        skipping = SkipBatchSampler(dataloader.sampler, skip_batches=num_batches)
        return DataLoader(dataloader.dataset, sampler=skipping, batch_size=dataloader.batch_size, **kwargs)
    skipping = SkipBatchSampler(dataloader.batch_sampler, skip_batches=num_batches)
    return DataLoader(dataloader.dataset, batch_sampler=skipping, **kwargs)


@overload
def skip_first_batches(dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard: ...


@overload
def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader: ...


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A copy of ``dataloader`` whose iterations start after ``num_batches`` batches (to resume mid-epoch).

    A prepared loader (:class:`DataLoaderShard`, :class:`DataLoaderDispatcher`) is copied with its epoch, position
    and sharding. Any other ``DataLoader`` becomes, as in Accelerate, a ``DataLoader`` over a
    :class:`SkipBatchSampler` (map-style datasets) or a :class:`SkipDataLoader` (iterable datasets).

    Raises:
        TypeError: If ``dataloader`` is not a ``DataLoader``.
        ValueError: If ``num_batches`` is negative.

    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}.")
    if not isinstance(dataloader, DataLoaderShard):
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"skip_first_batches needs a torch DataLoader, got {type(dataloader).__name__}.")
        return _skip_plain_loader(dataloader, num_batches)
    skipping = copy.copy(dataloader)
    skipping.skip_batches = num_batches
    dataloader.resume_position = 0  # the copy takes over a position (and random states) restored by load_state
    dataloader.resume_rng_states = None
    return skipping
