"""The loader classes ``Accelerator.prepare`` returns: :class:`DataLoaderShard` and :class:`DataLoaderDispatcher`.

:class:`DataLoaderShard` iterates this process's share of the data (see :mod:`lightning_accel.data_loader.sharding`),
one batch ahead so that ``end_of_dataloader`` is known while the last batch is processed. :class:`DataLoaderDispatcher`
is Accelerate's dispatch mode: process 0 reads, every process receives its slice. Both can draw their batches from
torchdata's ``StatefulDataLoader`` (``use_stateful_dataloader``), whose state ``state_dict()`` returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import Self, override

from lightning_accel.data_loader.sharding import BatchSamplerShard
from lightning_accel.state import GradientState, PartialState
from lightning_accel.state.shared_errors import shareable
from lightning_accel.utils.operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from lightning_accel.utils.random import set_rng_states, synchronize_rng_states

__all__ = [
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "register_stateful_base",
    "stateful_dataloader_class",
    "stateful_variant",
]

_L = TypeVar("_L", bound=type)
_VARIANT_PREFIX = "_Stateful"
_STATEFUL_BASES: dict[str, type] = {}  # loader classes with a StatefulDataLoader variant, by name
_STATEFUL_VARIANTS: dict[type, type] = {}

_STATEFUL_HINT = "pip install 'lightning-accel[stateful]' (or pip install 'torchdata>=0.8')"


def stateful_dataloader_class() -> type[DataLoader]:
    """The ``StatefulDataLoader`` class of torchdata.

    Raises:
        ImportError: If torchdata (0.8 or newer) is not installed.

    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as err:
        raise ImportError(
            "DataLoaderConfiguration(use_stateful_dataloader=True) needs the StatefulDataLoader of torchdata>=0.8,"
            f" which is not installed: {_STATEFUL_HINT}, or leave use_stateful_dataloader=False."
        ) from err
    return StatefulDataLoader


def register_stateful_base(cls: _L) -> _L:
    """Let ``cls`` have a :func:`stateful_variant` that pickled loaders find again (a class decorator)."""
    _STATEFUL_BASES[cls.__name__] = cls
    return cls


def stateful_variant(cls: _L) -> _L:
    """``cls`` combined with torchdata's ``StatefulDataLoader``: the class of a loader with ``use_stateful_dataloader``.

    A loader built with ``use_stateful_dataloader=True`` is then a ``StatefulDataLoader`` (``isinstance``), as in
    Accelerate. The variant keeps ``cls``'s name and behaviour (its methods come first); ``StatefulDataLoader``'s
    ``__init__`` sets the loader up. It is reachable as ``_Stateful<name>`` in this module, so pickled loaders load in
    a new process too.

    Raises:
        ImportError: If torchdata (0.8 or newer) is not installed.

    """
    stateful = stateful_dataloader_class()
    if issubclass(cls, stateful):
        return cls
    variant = _STATEFUL_VARIANTS.get(cls)
    if variant is None:
        namespace = {"__module__": __name__, "__qualname__": f"{_VARIANT_PREFIX}{cls.__name__}", "__doc__": cls.__doc__}
        variant = type(cls.__name__, (cls, stateful), namespace)
        _STATEFUL_VARIANTS[cls] = variant
    return variant  # type: ignore[return-value]  # a subclass of cls


if not TYPE_CHECKING:  # a module attribute hook would hide typos in every import from this module from mypy

    def __getattr__(name: str) -> Any:
        """Build ``_Stateful<name>`` variants on first access (what unpickling a stateful loader asks for)."""
        base = _STATEFUL_BASES.get(name[len(_VARIANT_PREFIX) :]) if name.startswith(_VARIANT_PREFIX) else None
        if base is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return stateful_variant(base)


class DataLoaderStateMixin:
    """What a loader tells :class:`~lightning_accel.state.GradientState` while it is iterated (Accelerate's mixin).

    A loader class mixes it in, sets ``self.gradient_state = GradientState()``, calls :meth:`begin` before its first
    batch and :meth:`end` after its last, and sets ``end_of_dataloader`` when the batch it hands out is the last one;
    gradient accumulation then syncs on the last batch, and ``gather_for_metrics`` drops ``remainder``'s padding.

    Attributes:
        end_of_dataloader: Whether the batch being processed is the loader's last.
        remainder: Samples in the last global batch (``-1`` when unknown or when the last batch is dropped).

    """

    end_of_dataloader: bool = False
    remainder: int = -1
    gradient_state: GradientState

    def reset(self) -> None:
        """Forget the previous iteration's end and remainder."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start an iteration: reset, compute the remainder and become the gradient state's active loader."""
        self.reset()
        self.remainder = self._initial_remainder()
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """Finish an iteration: the gradient state's active loader goes back to the enclosing one (if any)."""
        self.gradient_state._remove_dataloader(self)

    def _initial_remainder(self) -> int:
        """Dataset length modulo the global batch size; ``-1`` with ``drop_last`` or when either is unknown."""
        loader: Any = self  # a DataLoader subclass: dataset, drop_last and total_batch_size are its attributes
        if getattr(loader, "drop_last", False):
            return -1
        try:
            length = getattr(loader.dataset, "total_dataset_length", None)
            return int(len(loader.dataset) if length is None else length) % int(loader.total_batch_size)
        except (TypeError, AttributeError):  # an unsized dataset, or no known batch size
            return -1


@register_stateful_base
class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` that moves batches to the device and tells :class:`GradientState` when its last batch comes.

    It looks one batch ahead, so ``end_of_dataloader`` is already true while the last batch is processed.

    Args:
        dataset: The dataset (this process's share of it, or the whole one with a sharded sampler).
        device: Where batches go (``None`` keeps them where the collate function put them).
        rng_types: Generators synchronised from process 0 at the start of each iteration.
        synchronized_generator: The generator of ``"generator"`` in ``rng_types``.
        skip_batches: Batches skipped at the start of every iteration.
        use_stateful_dataloader: Draw the batches from torchdata's ``StatefulDataLoader`` (built with the same
            arguments), whose state :meth:`state_dict` returns; the loader is then a ``StatefulDataLoader`` itself
            (see :func:`stateful_variant`).
        non_blocking: Non-blocking host-to-device copies.
        source_drop_last: ``drop_last`` of the loader this one was prepared from (no remainder when true).
        torch_device_mesh: The device mesh of an N-D parallel run (recorded; the sampler is sharded over its ``dp``
            dimension when the loader is prepared).
        iteration: The epoch the first iteration starts at.
        **kwargs: ``DataLoader`` keyword arguments (``batch_size``, ``sampler``, ``collate_fn``, ...).

    Attributes:
        iteration: The epoch of the next iteration (passed to ``set_epoch`` of the samplers).
        end_of_dataloader: Whether the batch being processed is the last one.
        remainder: Samples in the last global batch (``-1`` when unknown or with ``drop_last``).
        position: Batches of the current epoch handed out so far (0 between epochs); ``load_state`` resumes there.

    """

    _STATEFUL_POSITION: ClassVar[int] = 5  # where ``use_stateful_dataloader`` comes in Accelerate's positional order

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Create the loader; with ``use_stateful_dataloader`` as its :func:`stateful_variant` class."""
        position = cls._STATEFUL_POSITION
        stateful = kwargs.get("use_stateful_dataloader", args[position] if len(args) > position else False)
        return super().__new__(stateful_variant(cls) if stateful else cls)

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: Sequence[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        *,
        non_blocking: bool = False,
        source_drop_last: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.device = device
        self.torch_device_mesh = torch_device_mesh
        self.rng_types = list(rng_types or ())
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.non_blocking = non_blocking
        self.source_drop_last = source_drop_last
        self.use_stateful_dataloader = use_stateful_dataloader
        base: Any = (stateful_dataloader_class() if use_stateful_dataloader else DataLoader)(dataset, **kwargs)
        self.base_dataloader = base  # the loader the batches are drawn from, as in Accelerate
        self._state: dict[str, Any] = base.state_dict() if use_stateful_dataloader else {}
        self._resumed_batches = 0
        self.iteration = iteration
        self.end_of_dataloader = False
        self.remainder = -1
        self.position = 0
        self.resume_position = 0  # one-shot skip for the next iteration, set by load_state
        # Random states load_state read, put back once the skipped batches are drawn (see _restore_resumed_rng).
        self.resume_rng_states: dict[str, Any] | None = None
        self.gradient_state = GradientState()

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes.

        Raises:
            TypeError: If the batch sampler has no ``batch_size``.

        """
        is_batch_sampler = isinstance(self.sampler, (BatchSampler, BatchSamplerShard))
        sampler: Any = self.sampler if is_batch_sampler else self.batch_sampler
        size = getattr(sampler, "batch_size", None)
        if size is None:
            raise TypeError(f"The total batch size is unknown: {type(sampler).__name__} has no batch_size.")
        if getattr(sampler, "split_batches", False):
            return int(size)
        return int(size) * int(getattr(sampler, "num_processes", 1))

    @property
    def total_dataset_length(self) -> int:
        """Samples in the dataset (over all processes)."""
        return len(self.dataset)  # type: ignore[arg-type]

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not a _BaseDataLoaderIter
        synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        try:
            self.set_epoch(self.iteration)
            skip, self.resume_position = max(self.skip_batches, self.resume_position), 0
            yield from self._stream(skip)
            self.iteration += 1
            self.position = 0
            self._resumed_batches = 0
        finally:
            self.end()

    def _base_batches(self) -> Iterator[Any]:
        """The batches of this process's loader (torchdata's ``StatefulDataLoader`` when stateful)."""
        return iter(self.base_dataloader)

    def _stream(self, skip: int) -> Iterator[Any]:
        """Hand out the batches one ahead of the loader, after skipping the first ``skip``.

        Its loop runs once per batch: the attributes it updates are set with ``object.__setattr__``, past
        ``DataLoader.__setattr__`` (a Python call that guards the loader's own arguments, which these are not).
        """
        batches = self._base_batches()
        position = self.position = self._resumed_batches + skip
        current = self._skip(batches, skip)
        device, non_blocking, stateful = self.device, self.non_blocking, self.use_stateful_dataloader
        while current is not _END:
            if device is not None:
                current = send_to_device(current, device, non_blocking)
            if stateful:
                self._snapshot()
            upcoming = next(batches, _END)
            if upcoming is _END:  # begin() set it False
                object.__setattr__(self, "end_of_dataloader", True)
                self._snapshot()
            position += 1
            object.__setattr__(self, "position", position)
            yield current
            current = upcoming

    def _skip(self, batches: Iterator[Any], skip: int) -> Any:
        """Read past the first ``skip`` batches; the first batch to hand out (``_END`` if none is left)."""
        current = next(batches, _END)
        for _ in range(skip):
            if current is _END:
                return _END
            current = next(batches, _END)
            if current is _END:
                object.__setattr__(self, "end_of_dataloader", True)
                self._snapshot()
        if current is not _END:
            self._restore_resumed_rng()
        return current

    def _restore_resumed_rng(self) -> None:
        """Set the random states of a checkpoint taken mid-epoch, at the batch the checkpoint's run was at.

        ``load_state`` sets them at once, but resuming mid-epoch then starts a new iteration (torch's loader draws
        its base seed from the global generator) and redraws the skipped batches, which the checkpointed run had
        done before it saved: setting the states again here keeps dropout and the like on the uninterrupted run's
        numbers.
        """
        if self.resume_rng_states is not None:
            set_rng_states(self.resume_rng_states)
            self.resume_rng_states = None

    @override
    def _initial_remainder(self) -> int:
        if self.source_drop_last:
            return -1
        try:
            return self.total_dataset_length % self.total_batch_size
        except TypeError:  # an unsized dataset or an unknown batch size
            return -1

    # ---- stateful loaders ----------------------------------------------------------------------------------------

    def _snapshot(self) -> None:
        """Record the stateful loader's state as of the batches handed out (it runs one batch ahead)."""
        if not self.use_stateful_dataloader:
            return
        self._state = self.base_dataloader.state_dict()
        self._adjust_state_for_prefetch()
        self._state["_iterator_finished"] = self.end_of_dataloader

    def _adjust_state_for_prefetch(self) -> None:
        """Correct the recorded state for batches read ahead (none here: the snapshot precedes the read)."""

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, to resume from with :meth:`load_state_dict`.

        With ``use_stateful_dataloader`` it is torchdata's ``StatefulDataLoader`` state as of the last batch handed
        out (as in Accelerate); otherwise the epoch and the batches of it handed out so far.
        """
        if self.use_stateful_dataloader:
            return self._state
        return {"iteration": self.iteration, "position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`: the next iteration continues where that one stopped."""
        if self.use_stateful_dataloader:
            self.base_dataloader.load_state_dict(state_dict)
            finished = bool(state_dict.get("_iterator_finished", False))
            self._resumed_batches = 0 if finished else int(state_dict.get("_num_yielded", 0))
            return
        self.iteration = int(state_dict["iteration"])
        self.resume_position = int(state_dict["position"])

    # ---- epochs --------------------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader and of the samplers (or dataset) below it that have ``set_epoch``.

        Moving to another epoch than the one ``load_state`` restored drops the restored position.
        """
        if epoch != self.iteration:
            self.resume_position = 0
        self.iteration = epoch
        self._set_sampler_epochs(epoch)

    def _set_sampler_epochs(self, epoch: int) -> None:
        # The samplers Accelerate's DataLoaderShard.set_epoch reaches, in its order.
        batch_sampler: Any = self.batch_sampler
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        if hasattr(getattr(batch_sampler, "sampler", None), "set_epoch"):
            batch_sampler.sampler.set_epoch(epoch)
        inner: Any = getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


_END = object()


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(batch: Any) -> Any:
    return recursively_apply(lambda t: _TensorSpec(tuple(t.shape), t.dtype), batch)


def _empty(spec: Any) -> Any:
    return recursively_apply(
        lambda s: torch.empty(s.shape, dtype=s.dtype), spec, test_type=lambda x: isinstance(x, _TensorSpec)
    )


@register_stateful_base
class DataLoaderDispatcher(DataLoaderShard):
    """A loader iterated by process 0 only, whose batches are broadcast and sliced: Accelerate's dispatch mode.

    Without ``split_batches`` process 0 reads ``num_processes`` batches per step, concatenates them and process ``p``
    keeps the ``p``-th slice (one original batch); with it, each batch is sliced. A last global batch that does not
    divide evenly is completed with samples from the first one (unless ``drop_last``), and ``remainder`` becomes its
    size. Every process builds an iterator of the loader (random generators advance as in Accelerate).

    Unlike HF accelerate's, :func:`skip_first_batches` skips dispatched batches (the ones a process sees), for
    map-style datasets too, and a batch that cannot be concatenated, or an exception of the dataset (or collate
    function) on process 0, raises on every process instead of stalling the others.

    Args:
        dataset: The original dataset (not sharded).
        split_batches: Slice each batch instead of dealing whole batches.
        skip_batches: Batches skipped at the start of every iteration.
        use_stateful_dataloader: As for :class:`DataLoaderShard`.
        slice_fn: ``slice_fn(batch, slice, process_index=, num_processes=)`` (default :func:`slice_tensors`).
        num_processes: Number of processes (default: the state's).
        process_index: This process's rank (default: the state's).
        **kwargs: :class:`DataLoaderShard` keyword arguments; without ``device`` the batches are broadcast where the
            collate function put them (CPU for gloo).

    """

    _STATEFUL_POSITION: ClassVar[int] = 3

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        *,
        num_processes: int | None = None,
        process_index: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader, **kwargs)
        state = PartialState()
        self.num_processes = state.num_processes if num_processes is None else num_processes
        self.process_index = state.process_index if process_index is None else process_index
        self.split_batches = split_batches
        self.slice_fn = slice_fn or slice_tensors
        self._stopped = False

    @property
    @override
    def total_batch_size(self) -> int:
        """Samples per step over all processes."""
        size = self.batch_size or getattr(self.batch_sampler, "batch_size", None)
        if size is None:
            raise TypeError(f"The total batch size is unknown: {type(self.batch_sampler).__name__} has no batch_size.")
        return int(size) if self.split_batches else int(size) * self.num_processes

    def __len__(self) -> int:
        whole = len(self.base_dataloader)
        if self.split_batches:
            return whole
        return whole // self.num_processes if self.source_drop_last else math.ceil(whole / self.num_processes)

    @override
    def _initial_remainder(self) -> int:
        return -1  # known at the last batch only (its size), as in Accelerate

    @override
    def _set_sampler_epochs(self, epoch: int) -> None:
        if hasattr(getattr(self.batch_sampler, "sampler", None), "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @override
    def _adjust_state_for_prefetch(self) -> None:
        # Accelerate's correction: process 0 has read num_processes - 1 batches more than the state should count.
        ahead = self.num_processes - 1
        for key in ("_sampler_iter_yielded", "_num_yielded"):
            if self._state.get(key, 0) > 0:
                self._state[key] -= ahead
        sampler_state = self._state.get("_index_sampler_state")
        if isinstance(sampler_state, dict) and sampler_state.get("samples_yielded", 0) > 0:
            sampler_state["samples_yielded"] -= (self.batch_size or 1) * ahead

    @override
    def _stream(self, skip: int) -> Iterator[Any]:
        batches = self._base_batches()  # on every process, as Accelerate does
        self._stopped = False
        first = None
        upcoming = self._fetch(batches)
        index, stop = 0, False
        self.position = skip
        while not stop and upcoming[1][0] is not None:
            if index == skip:
                self._restore_resumed_rng()
            batch, (spec, _) = upcoming
            batch = batch if self.process_index == 0 else _empty(spec)
            if self.device is not None:
                batch = send_to_device(batch, self.device, non_blocking=self.non_blocking)
            batch = broadcast(batch, from_process=0)
            if not self.source_drop_last and first is None:
                first = self._slice(batch, slice(0, self.num_processes))
            observed = find_batch_size(batch)
            stop = self._stopped
            if not stop:
                upcoming = self._fetch(batches)
                stop = self._stopped and upcoming[1][0] is None
            share = observed // self.num_processes
            if not self.source_drop_last and stop and observed % self.num_processes != 0:
                batch, share = concatenate([batch, first]), share + 1
            batch = self._slice(batch, slice(self.process_index * share, (self.process_index + 1) * share))
            if stop:
                self.end_of_dataloader = True
                self._snapshot()
                self.remainder = observed
            if index >= skip:
                self.position = index + 1
                yield batch
            index += 1

    def _slice(self, batch: Any, part: slice) -> Any:
        return self.slice_fn(batch, part, process_index=self.process_index, num_processes=self.num_processes)

    def _fetch(self, batches: Iterator[Any]) -> tuple[Any, list[Any]]:
        """Process 0 reads the next global batch; everyone learns its tensor shapes (or that the loader is done)."""
        batch: Any = None
        parts: list[Any] = []
        info: list[Any] = [None, self._stopped, None]  # shapes, stopped, error
        failure: Exception | None = None
        if self.process_index == 0:
            try:
                for _ in range(1 if self.split_batches else self.num_processes):
                    parts.append(self._read(batches))  # one by one: a last, incomplete round keeps what was read
                batch, info = self._joined(parts)
            except StopIteration:
                info = [None, True, None]
            except Exception as err:  # the dataset's or collate function's: every process raises it
                failure, info = err, [None, True, shareable(err)]
        broadcast_object_list(info)
        _raise_dispatch_error(failure or info[2])
        self._stopped = bool(info[1])
        if self._stopped and not self.split_batches and not self.source_drop_last:
            # The last round may be incomplete: dispatch what was read.
            info = [None, True, None]
            if self.process_index == 0 and parts:
                batch, info = self._joined(parts)
            broadcast_object_list(info)
            _raise_dispatch_error(info[2])
        return batch, info[:2]

    def _read(self, batches: Iterator[Any]) -> Any:
        self._snapshot()
        return next(batches)

    def _joined(self, parts: list[Any]) -> tuple[Any, list[Any]]:
        try:
            batch = parts[0] if self.split_batches else concatenate(parts, dim=0)
        except (RuntimeError, TypeError) as err:
            message = (
                f"dispatch_batches=True could not concatenate {len(parts)} batches ({err}): batches must be tensors"
                " of one shape except the first dimension. Pass DataLoaderConfiguration(dispatch_batches=False) so"
                " that each process reads its own batches, or split_batches=True so that process 0 reads one batch"
                " and slices it."
            )
            return None, [None, True, message]
        return batch, [_spec(batch), False, None]


def _raise_dispatch_error(error: str | BaseException | None) -> None:
    """Raise what process 0 met while reading (a message of ours, or the dataset's own exception)."""
    if isinstance(error, BaseException):
        raise error
    if error is not None:
        raise RuntimeError(error)
