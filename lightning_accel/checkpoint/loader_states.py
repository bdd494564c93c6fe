"""The data-loader part of ``save_state`` / ``load_state``.

Two records, each read back exactly once per loader so that nothing is skipped twice:

- ``dl_state_dict.bin``, ``dl_state_dict_1.bin``, ... (Accelerate 1.15's names, ``i`` = index among the prepared
  loaders): torchdata's ``StatefulDataLoader`` state of each loader prepared with ``use_stateful_dataloader``, written
  by the process that writes the shared files (Accelerate has every process write the same file). Loading it resumes
  the loader mid-epoch by itself.
- Our keys in ``random_states_{rank}.pkl`` (Accelerate ignores unknown keys): each loader's epoch and the batches of
  it already handed out. The epoch is always restored (Accelerate restores none, and replays epoch 0's order); the
  position only for loaders that have no ``dl_state_dict`` file to resume from.

The same file records what the positions are checked against on load: the number of processes and each loader's
length (batches per epoch on each process). A position belongs to one world size and one loader: saved by another
number of processes, the epoch is restored but not the position within it (nor a ``dl_state_dict`` file), with a
warning naming both counts; a position past the loader's end is refused, naming the file. Folders without the record
(HF accelerate's, older ones) are loaded as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lightning_accel.state import PartialState
from lightning_accel.utils.constants import RNG_STATE_NAME
from lightning_accel.utils.other import torch_save

__all__ = ["ResumableLoader", "loader_positions", "restore_loaders", "save_loader_states", "state_file_name"]

_EPOCHS = "dataloader_iterations"
_POSITIONS = "dataloader_positions"  # batches of that epoch already handed out
_FINISHED = "_iterator_finished"  # set in a stateful loader's state when its last batch was handed out
_LENGTHS = "dataloader_lengths"  # batches per epoch on each process, when saved
_NUM_PROCESSES = "num_processes"  # processes of the run that saved


class SavedLoader(Protocol):
    """What a checkpoint writes of a data loader: its state, where it is stateful."""

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether the loader is a ``torchdata`` ``StatefulDataLoader`` whose state is saved."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The stateful loader's state (with ``use_stateful_dataloader``)."""
        ...


class ResumableLoader(Protocol):
    """What a checkpoint reads and sets on a prepared data loader (the shim's ``DataLoaderShard``)."""

    use_stateful_dataloader: bool
    iteration: int  # the epoch of the next iteration
    position: int  # batches of the current epoch already handed out
    resume_position: int  # batches the next iteration skips
    resume_rng_states: dict[str, Any] | None  # random states to set once those are skipped

    def state_dict(self) -> dict[str, Any]:
        """The stateful loader's state (with ``use_stateful_dataloader``)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the stateful loader from ``state_dict``."""
        ...

    def __len__(self) -> int:
        """Batches per epoch on this process (``TypeError`` without a length)."""
        ...


def state_file_name(index: int) -> str:
    """Accelerate's file name for the state of the ``index``-th prepared loader."""
    return "dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin"


def save_loader_states(loaders: Sequence[SavedLoader], target: Path) -> None:
    """Write the state of every stateful loader as ``dl_state_dict{_i}.bin`` into ``target`` (one process calls it)."""
    for index, loader in enumerate(loaders):
        if loader.use_stateful_dataloader:
            torch_save(loader.state_dict(), target / state_file_name(index))


def loader_positions(loaders: Sequence[ResumableLoader]) -> dict[str, Any]:
    """Our keys of ``random_states_{rank}.pkl``: each loader's epoch, position and length, and the process count."""
    return {
        _EPOCHS: [loader.iteration for loader in loaders],
        _POSITIONS: [loader.position for loader in loaders],
        _LENGTHS: [_length(loader) for loader in loaders],
        _NUM_PROCESSES: PartialState().num_processes,
    }


def _length(loader: ResumableLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset without a length
        return None


def restore_loaders(
    loaders: Sequence[ResumableLoader],
    source: Path,
    rng_states: Mapping[str, Any] | None,
    read: Callable[[Path], Any],
    *,
    positions: bool = True,
) -> None:
    """Resume each loader where the checkpoint in ``source`` left it.

    Args:
        loaders: The prepared loaders, in prepare order.
        source: The checkpoint folder.
        rng_states: This process's ``random_states_{rank}.pkl`` content, or ``None`` when it is missing (then the
            epochs are read from process 0's file, so every process starts the same epoch).
        read: Reads a checkpoint file (and names it in the error if it cannot).
        positions: Also resume each loader at the batch of its epoch it had reached; ``False`` restores the epochs
            only, and the next iteration starts at the epoch's first batch (as Accelerate's, for loops that skip the
            batches already trained on themselves).

    Raises:
        ValueError: If a recorded position lies past its loader's end (the file is from another run), naming the
            position, the length and the file.

    """
    state = PartialState()
    own_file = source / f"{RNG_STATE_NAME}_{state.process_index}.pkl"
    record: Mapping[str, Any]
    record, file = (rng_states, own_file) if rng_states is not None else _first_process_record(source, read)
    saved_processes = record.get(_NUM_PROCESSES)
    other_world = saved_processes is not None and saved_processes != state.num_processes
    epochs, recorded_positions = _recorded(record, len(loaders))
    if other_world or rng_states is None or not positions:
        recorded_positions = None  # another world size: batches of one process's shard mean nothing to it
    lengths = record.get(_LENGTHS)
    for index, loader in enumerate(loaders):
        state_file = source / state_file_name(index)
        if loader.use_stateful_dataloader and state_file.is_file() and not other_world:
            loaded = read(state_file)
            loader.load_state_dict(loaded)  # resumes mid-epoch by itself: no position skip on top
            if epochs is not None:
                # A state saved at the epoch's last batch resumes with the next epoch, as the uninterrupted run would.
                loader.iteration = epochs[index] + int(bool(loaded.get(_FINISHED, False)))
                loader.resume_position = 0
        elif epochs is not None:
            loader.iteration = epochs[index]
            saved_length = lengths[index] if isinstance(lengths, list) and len(lengths) == len(loaders) else None
            recorded = recorded_positions[index] if recorded_positions else 0
            position = _checked_position(index, loader, recorded, saved_length, file)
            loader.resume_position = position
            loader.resume_rng_states = dict(record) if position else None
    if other_world and loaders and saved_processes is not None:
        _warn_other_world(source, saved_processes, state.num_processes, epochs)


def _first_process_record(source: Path, read: Callable[[Path], Any]) -> tuple[Mapping[str, Any], Path]:
    """Process 0's record (for the epochs), for a process whose own file is missing; empty without one."""
    file = source / f"{RNG_STATE_NAME}_0.pkl"
    return (read(file) if file.is_file() else {}), file


def _checked_position(index: int, loader: ResumableLoader, position: int, saved_length: int | None, file: Path) -> int:
    """The position to resume ``loader`` at: ``position`` if it belongs to this loader.

    Raises:
        ValueError: If ``position`` lies past the loader's end: the epoch would silently yield nothing.

    """
    length = _length(loader)
    if not position or length is None:
        return position
    if position > length:
        raise ValueError(
            f"{file} resumes data loader {index} at batch {position} of its epoch, but the loader has {length} "
            f"batches per epoch{'' if saved_length is None else f' (the run that saved had {saved_length})'}, so "
            "the epoch would yield nothing. The checkpoint belongs to another run (another dataset, batch size or "
            "number of processes): load this run's checkpoint, or prepare the data loader the checkpoint was saved with"
        )
    if saved_length is not None and saved_length != length:
        warnings.warn(
            f"{file} records data loader {index} with {saved_length} batches per epoch, but it has {length} now "
            f"(another dataset or batch size): its position in the epoch (batch {position}) is not restored, the "
            "epoch starts from its first batch. Model, optimizer, scheduler and random states are restored.",
            stacklevel=4,
        )
        return 0
    return position


def _warn_other_world(source: Path, saved: int, current: int, epochs: list[int] | None) -> None:
    epoch = "" if epochs is None else f" (epochs {epochs} are)"
    warnings.warn(
        f"Checkpoint {source} was saved by {saved} processes and is loaded by {current}: model, optimizer, scheduler "
        f"and random states are restored, and the data loaders' epochs{epoch}, but not their positions within the "
        f"epoch, which count the batches of one process's shard at {saved} processes: the epoch starts again from "
        "its first batch (its samples already trained on are seen again). Resume with the same number of processes "
        "to continue exactly.",
        stacklevel=4,
    )


def _recorded(states: Mapping[str, Any], count: int) -> tuple[list[int] | None, list[int] | None]:
    """The epochs and positions recorded for ``count`` loaders, or ``None`` where they are missing or do not fit."""
    epochs = states.get(_EPOCHS)
    if epochs is None or len(epochs) != count:
        return None, None
    positions = states.get(_POSITIONS) or [0] * count
    return [int(e) for e in epochs], ([int(p) for p in positions] if len(positions) == count else None)
