"""How one process's share of a data loader is cut: batch samplers and iterable datasets dealt out like Accelerate.

Both classes reproduce Accelerate 1.15's order exactly, so a script draws the same samples on each process here and
under HF accelerate:

- :class:`BatchSamplerShard` wraps any batch sampler (torch's ``BatchSampler`` or a custom one). Without
  ``split_batches`` process ``p`` takes batches ``p, p + P, ...``; with it, every batch is cut into ``P`` slices.
  ``even_batches`` pads the last round with samples from the start of the epoch; without it processes may get fewer
  (or shorter) batches.
- :class:`IterableDatasetShard` buffers ``batch_size * P`` samples of a stream (``batch_size`` with
  ``split_batches``) and each process keeps its slice of the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler
from typing_extensions import override

__all__ = ["BatchSamplerShard", "IterableDatasetShard", "check_split_batch_size"]


def check_split_batch_size(batch_size: int | None, num_processes: int, what: str) -> None:
    """Check that batches of ``batch_size`` can be split evenly between ``num_processes`` processes.

    Raises:
        ValueError: If ``batch_size`` is unknown or not a multiple of ``num_processes``.

    """
    if batch_size is None:
        raise ValueError(
            f"split_batches=True needs the batch size of {what}, but it has none (batch_size=None and no"
            " `batch_size` attribute on its batch sampler); give the DataLoader a batch_size or the batch sampler a"
            " `batch_size` attribute, or leave split_batches=False."
        )
    if batch_size > 1 and batch_size % num_processes != 0:
        raise ValueError(
            f"split_batches=True splits each batch of {what} between the {num_processes} processes, so its batch size"
            f" must be a round multiple of {num_processes}; got batch_size={batch_size}. Use a batch size such as"
            f" {num_processes * max(1, batch_size // num_processes)}, or leave split_batches=False."
        )


@dataclass(eq=False)
class BatchSamplerShard(Sampler[list[int]]):
    """The batches of one process, cut from the batches of ``batch_sampler`` as Accelerate's ``BatchSamplerShard``.

    Args:
        batch_sampler: The batch sampler of the original loader (any iterable of index lists; its ``batch_size`` and
            ``drop_last`` attributes are read when present).
        num_processes: Number of processes.
        process_index: This process's rank.
        split_batches: Cut every batch into ``num_processes`` slices instead of dealing whole batches.
        even_batches: Pad the last round with indices from the start so that every process gets as many batches of
            full size; without it the last round is dealt as it is.

    Raises:
        ValueError: With ``split_batches`` when the batch size is unknown or not a multiple of ``num_processes``.

    """

    batch_sampler: Iterable[list[int]]
    num_processes: int = 1
    process_index: int = 0
    split_batches: bool = False
    even_batches: bool = True
    batch_size: int | None = field(init=False)
    drop_last: bool = field(init=False)

    def __post_init__(self) -> None:
        self.batch_size = getattr(self.batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(self.batch_sampler, "drop_last", False))
        if self.split_batches:
            check_split_batch_size(self.batch_size, self.num_processes, "the batch sampler")
            if self.batch_size == 1 and self.num_processes > 1:
                raise ValueError(
                    f"split_batches=True cannot split batches of 1 sample between {self.num_processes} processes;"
                    f" use a batch size that is a multiple of {self.num_processes}."
                )

    @property
    def total_length(self) -> int:
        """Batches of the wrapped batch sampler."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        total = self.total_length
        if self.split_batches:
            return total
        rounds, rest = divmod(total, self.num_processes)
        if rest == 0 or self.drop_last:
            return rounds
        if self.even_batches or self.process_index < rest:
            return rounds + 1
        return rounds

    @override
    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split_batches else self._deal()

    def _is_full(self, batch: list[int]) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    # ---- split_batches=True: a slice of every batch ---------------------------------------------------------------

    def _split(self) -> Iterator[list[int]]:
        assert self.batch_size is not None
        width = self.batch_size // self.num_processes
        start = width * self.process_index
        first: list[int] = []
        last: list[int] = []
        for batch in self.batch_sampler:
            first = first or list(batch)
            last = list(batch)
            if len(batch) == self.batch_size:
                yield last[start : start + width]
        if self.drop_last or not first or len(last) >= self.batch_size:
            return
        if not self.even_batches:
            if len(last) > start:
                yield last[start : start + width]
            return
        padded = last + _cycle(first, self.batch_size)
        yield padded[start : start + width]

    # ---- split_batches=False: whole batches, one per process and round -------------------------------------------

    def _deal(self) -> Iterator[list[int]]:
        head: list[list[int]] = []  # the first round, to pad the last one from
        mine: list[int] | None = None
        last: list[int] = []
        count = 0
        for index, batch in enumerate(self.batch_sampler):
            if not self.drop_last and index < self.num_processes:
                head.append(list(batch))
            if index % self.num_processes == self.process_index:
                mine = list(batch)
            if index % self.num_processes == self.num_processes - 1 and self._is_full(batch):
                yield mine  # type: ignore[misc]  # set: this process's index in the round came first
                mine = None
            last, count = list(batch), index + 1
        if self.drop_last or not head:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and self._is_full(mine):
            yield mine
        yield from self._pad_last_round(head, last, count)

    def _pad_last_round(self, head: list[list[int]], last: list[int], count: int) -> Iterator[list[int]]:
        """Complete the last round with batches made of the first round's indices (whole batches without a size)."""
        size = self.num_processes
        if self.batch_size is None:
            pool: list[Any] = _cycle(head, size)
            slot = count
            for batch in pool:
                if slot % size == 0:
                    return
                if slot % size == self.process_index:
                    yield batch
                slot += 1
            return
        pool = _cycle([index for batch in head for index in batch], size * self.batch_size)
        slot, batch = (count, []) if self._is_full(last) else (count - 1, last)
        taken = 0
        while slot % size != 0 or batch:
            need = self.batch_size - len(batch)
            batch = batch + pool[taken : taken + need]
            taken += need
            if slot % size == self.process_index:
                yield batch
            batch = []
            slot += 1


def _cycle(items: list[Any], length: int) -> list[Any]:
    """``items`` repeated (whole) until there are at least ``length`` of them."""
    repeated = list(items)
    while repeated and len(repeated) < length:
        repeated += items
    return repeated


class IterableDatasetShard(IterableDataset):
    """One process's samples of an iterable dataset, as Accelerate's ``IterableDatasetShard`` deals them.

    The stream is read in buffers of ``batch_size * num_processes`` samples (``batch_size`` with ``split_batches``)
    and process ``p`` keeps slice ``p`` of each buffer. Without ``drop_last`` a last, incomplete buffer is completed
    with samples from the first buffer; with it, it is dropped.

    Args:
        dataset: The iterable dataset.
        batch_size: Samples per batch on each process (per global batch with ``split_batches``).
        drop_last: Drop the last incomplete buffer instead of completing it.
        num_processes: Number of processes.
        process_index: This process's rank.
        split_batches: ``batch_size`` is the global batch size, split between the processes.

    Raises:
        ValueError: With ``split_batches`` when ``batch_size`` is not a multiple of ``num_processes``.

    """

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if split_batches:
            check_split_batch_size(batch_size, num_processes, "the iterable dataset's loader")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and pass it to the dataset when it has ``set_epoch``."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this process yields (the dataset must be sized); counted per ``batch_size * num_processes``."""
        if not isinstance(self.dataset, Sized):
            raise TypeError(f"{type(self.dataset).__name__} has no length.")
        rounds = len(self.dataset) / (self.batch_size * self.num_processes)
        return int(math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.batch_size

    @override
    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)  # Accelerate reseeds a dataset's own generator with the epoch
        buffer_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        width = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * width, (self.process_index + 1) * width)
        first: list[Any] | None = None
        buffer: list[Any] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == buffer_size:
                yield from buffer[mine]
                first = first if first is not None else buffer
                buffer = []
        if self.drop_last or not buffer:
            return
        yield from (buffer + _cycle(first or buffer, buffer_size))[:buffer_size][mine]
