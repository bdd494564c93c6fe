"""Data loaders prepared by the ``Accelerator``: sharded across processes, epoch-aware, end-of-loader aware.

The order of samples is Accelerate's: :class:`SeedableRandomSampler` reseeds ``data_seed + epoch`` at each epoch, and
several processes take global batches ``p, p + P, ...`` (the last uneven round padded with samples from the start),
so the same script draws the same batches under Accelerate and here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
from typing_extensions import override

from lightning_accel.callbacks.seedable_sampler import shard_batches
from lightning_accel.state import GradientState
from lightning_accel.utils.operations import send_to_device
from lightning_accel.utils.random import synchronize_rng_states

__all__ = ["BatchSamplerShard", "DataLoaderShard", "SeedableRandomSampler", "prepare_data_loader", "skip_first_batches"]

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


class BatchSamplerShard(Sampler[list[int]]):
    """The batches of one process: global batches ``process_index, process_index + num_processes, ...``.

    Accelerate's default sharding (``even_batches=True``): without ``drop_last`` the last round is padded with samples
    from the start of the epoch so every process gets the same number of full batches.

    Args:
        sampler: The index sampler of the original loader.
        batch_size: Samples per batch on each process.
        drop_last: Drop the last incomplete round instead of padding it.
        num_processes: Number of processes.
        process_index: This process's rank.

    """

    def __init__(
        self, sampler: Sampler[int], batch_size: int, drop_last: bool, num_processes: int, process_index: int
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index

    @override
    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        yield from shard_batches(order, self.batch_size, self.num_processes, self.process_index, self.drop_last)

    def __len__(self) -> int:
        samples = len(self.sampler)  # type: ignore[arg-type]
        rounds, rest = divmod(samples, self.batch_size * self.num_processes)
        return rounds + (1 if rest and not self.drop_last else 0)


class DataLoaderShard(DataLoader):
    """A ``DataLoader`` that moves batches to the device and tells :class:`GradientState` when its last batch comes.

    It looks one batch ahead, so ``end_of_dataloader`` is already true while the last batch is processed.

    Attributes:
        device: Where batches go (``None`` keeps them where the collate function put them).
        iteration: The epoch of the next iteration (passed to ``set_epoch`` of the samplers).
        skip_batches: Batches skipped at the start of every iteration.
        end_of_dataloader: Whether the batch being processed is the last one.
        remainder: Samples in the last global batch (``-1`` when unknown or with ``drop_last``).
        position: Batches of the current epoch handed out so far (0 between epochs); ``load_state`` resumes there.

    """

    def __init__(
        self,
        *args: Any,
        device: torch.device | None = None,
        rng_types: Sequence[str] = (),
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        non_blocking: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.rng_types = list(rng_types)
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.non_blocking = non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        self.position = 0
        self.resume_position = 0  # one-shot skip for the next iteration, set by load_state
        self.gradient_state = GradientState()

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes."""
        sampler = self.batch_sampler
        return int(getattr(sampler, "batch_size", 1)) * int(getattr(sampler, "num_processes", 1))

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not a _BaseDataLoaderIter
        synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self._begin()
        try:
            self.set_epoch(self.iteration)
            skip, self.resume_position = max(self.skip_batches, self.resume_position), 0
            yield from self._look_ahead(super().__iter__(), skip)
            self.iteration += 1
            self.position = 0
        finally:
            self.gradient_state._remove_dataloader(self)

    def _look_ahead(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        current = next(batches, _END)
        index = 0
        self.position = skip
        while current is not _END:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self.non_blocking)
            upcoming = next(batches, _END)
            self.end_of_dataloader = upcoming is _END
            if index >= skip:
                self.position = index + 1
                yield current
            index += 1
            current = upcoming

    def _begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
        if not self.batch_sampler_drops_last and hasattr(self.dataset, "__len__"):
            self.remainder = len(self.dataset) % self.total_batch_size
        self.gradient_state._add_dataloader(self)

    @property
    def batch_sampler_drops_last(self) -> bool:
        """Whether incomplete batches are dropped."""
        return bool(getattr(self.batch_sampler, "drop_last", self.drop_last))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader and of every sampler below it that has ``set_epoch``.

        Moving to another epoch than the one ``load_state`` restored drops the restored position.
        """
        if epoch != self.iteration:
            self.resume_position = 0
        self.iteration = epoch
        batch_sampler: Any = self.batch_sampler
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        inner: Any = getattr(batch_sampler, "sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


_END = object()


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


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None,
    *,
    num_processes: int,
    process_index: int,
    rng_types: Sequence[str] = ("generator",),
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
) -> DataLoaderShard:
    """Rebuild ``dataloader`` as a :class:`DataLoaderShard` for this process.

    Raises:
        ValueError: For loaders this slice cannot shard yet (iterable datasets or custom batch samplers on several
            processes).

    """
    sampler: Any = dataloader.sampler
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(
            sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples, data_seed=data_seed
        )
    synchronized = None
    if num_processes > 1:
        _check_shardable(dataloader)
        if not use_seedable_sampler and isinstance(sampler, RandomSampler):
            if sampler.generator is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                sampler.generator = torch.Generator().manual_seed(seed)
            synchronized = sampler.generator
    batch_sampler = _batch_sampler(dataloader, sampler, num_processes, process_index)
    kwargs = {name: getattr(dataloader, name) for name in _CARRIED}
    if dataloader.num_workers > 0:
        kwargs.update({name: getattr(dataloader, name) for name in _WORKER_ONLY})
    return DataLoaderShard(
        dataloader.dataset,
        batch_sampler=batch_sampler,
        generator=dataloader.generator,
        device=device,
        rng_types=[t for t in rng_types if t != "generator" or synchronized is not None],
        synchronized_generator=synchronized,
        non_blocking=non_blocking,
        **kwargs,
    )


def _check_shardable(dataloader: DataLoader) -> None:
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            "Sharding a DataLoader over an IterableDataset across processes is not supported yet; use a map-style"
            " dataset (with __len__ and __getitem__) or shard the stream yourself."
        )
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        raise ValueError(
            f"Only DataLoaders built with batch_size= (a plain BatchSampler) can be sharded across processes yet, got"
            f" batch_sampler={type(dataloader.batch_sampler).__name__}; pass batch_size/shuffle/sampler instead."
        )


def _batch_sampler(
    dataloader: DataLoader, sampler: Sampler[int], num_processes: int, process_index: int
) -> Sampler[list[int]] | Any:
    original = dataloader.batch_sampler
    if num_processes == 1:
        if isinstance(original, BatchSampler) and type(original) is BatchSampler:
            return BatchSampler(sampler, original.batch_size, original.drop_last)
        return original
    assert dataloader.batch_size is not None
    return BatchSamplerShard(sampler, dataloader.batch_size, dataloader.drop_last, num_processes, process_index)


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
