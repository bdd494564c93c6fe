"""The data-loader part of ``save_state`` / ``load_state``.

Two records, each read back exactly once per loader so that nothing is skipped twice:

- ``dl_state_dict.bin``, ``dl_state_dict_1.bin``, ... (Accelerate 1.15's names, ``i`` = index among the prepared
  loaders): torchdata's ``StatefulDataLoader`` state of each loader prepared with ``use_stateful_dataloader``, written
  by the process that writes the shared files (Accelerate has every process write the same file). Loading it resumes
  the loader mid-epoch by itself.
- Our keys in ``random_states_{rank}.pkl`` (Accelerate ignores unknown keys): each loader's epoch and the batches of
  it already handed out. The epoch is always restored (Accelerate restores none, and replays epoch 0's order); the
  position only for loaders that have no ``dl_state_dict`` file to resume from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_accel._shim.data_loaders import DataLoaderShard

__all__ = ["loader_positions", "restore_loaders", "save_loader_states", "state_file_name"]

_EPOCHS = "dataloader_iterations"
_POSITIONS = "dataloader_positions"  # batches of that epoch already handed out
_FINISHED = "_iterator_finished"  # set in a stateful loader's state when its last batch was handed out


def state_file_name(index: int) -> str:
    """Accelerate's file name for the state of the ``index``-th prepared loader."""
    return "dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin"


def save_loader_states(loaders: Sequence[DataLoaderShard], target: Path) -> None:
    """Write the state of every stateful loader as ``dl_state_dict{_i}.bin`` into ``target`` (one process calls it)."""
    for index, loader in enumerate(loaders):
        if loader.use_stateful_dataloader:
            torch.save(loader.state_dict(), target / state_file_name(index))


def loader_positions(loaders: Sequence[DataLoaderShard]) -> dict[str, list[int]]:
    """Our keys of ``random_states_{rank}.pkl``: each loader's epoch and position."""
    return {_EPOCHS: [loader.iteration for loader in loaders], _POSITIONS: [loader.position for loader in loaders]}


def restore_loaders(
    loaders: Sequence[DataLoaderShard],
    source: Path,
    rng_states: Mapping[str, Any] | None,
    read: Callable[[Path], Any],
) -> None:
    """Resume each loader where the checkpoint in ``source`` left it.

    Args:
        loaders: The prepared loaders, in prepare order.
        source: The checkpoint folder.
        rng_states: This process's ``random_states_{rank}.pkl`` content, or ``None`` when it is missing.
        read: Reads a checkpoint file (and names it in the error if it cannot).

    """
    epochs, positions = _recorded(rng_states or {}, len(loaders))
    for index, loader in enumerate(loaders):
        state_file = source / state_file_name(index)
        if loader.use_stateful_dataloader and state_file.is_file():
            state = read(state_file)
            loader.load_state_dict(state)  # resumes mid-epoch by itself: no position skip on top
            if epochs is not None:
                # A state saved at the epoch's last batch resumes with the next epoch, as the uninterrupted run would.
                loader.iteration = epochs[index] + int(bool(state.get(_FINISHED, False)))
                loader.resume_position = 0
        elif epochs is not None and positions is not None:
            loader.iteration = epochs[index]
            loader.resume_position = positions[index]
            loader.resume_rng_states = dict(rng_states) if rng_states and positions[index] else None


def _recorded(states: Mapping[str, Any], count: int) -> tuple[list[int] | None, list[int] | None]:
    """The epochs and positions recorded for ``count`` loaders, or ``None`` where they are missing or do not fit."""
    epochs = states.get(_EPOCHS)
    if epochs is None or len(epochs) != count:
        return None, None
    positions = states.get(_POSITIONS) or [0] * count
    return [int(e) for e in epochs], ([int(p) for p in positions] if len(positions) == count else None)
