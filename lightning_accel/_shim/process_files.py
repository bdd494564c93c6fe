"""The files of a ``save_state`` that each process writes for itself, and the folder each process named.

Every process writes ``random_states_{rank}.pkl`` (its random states, and our record of where its loaders stand);
the main process writes the shared files (weights, optimizers, ...). Accelerate lets each process pass its own
``output_dir``: every process then writes its own files, including the state of its stateful data loaders, into the
folder it named, and later resumes from that folder. Ours writes the whole checkpoint into the main process's folder
(chosen once and broadcast, see :mod:`lightning_accel._shim.checkpoint_publish`); a process that named another folder
also gets its own files there, so a ``load_state`` of that folder resumes its loaders where they stood, as in
Accelerate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lightning_accel._shim.loader_checkpoint import loader_positions, save_loader_states
from lightning_accel.utils.constants import RNG_STATE_NAME
from lightning_accel.utils.random import get_rng_states

if TYPE_CHECKING:
    from lightning_accel.accelerator import Accelerator

__all__ = ["write_own_folder", "write_process_files"]


def write_process_files(accelerator: Accelerator, folder: Path) -> None:
    """Write this process's ``random_states_{rank}.pkl`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    states = {**get_rng_states(accelerator.step), **loader_positions(accelerator._dataloaders)}
    torch.save(states, folder / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl")


def write_own_folder(accelerator: Accelerator, requested: str | os.PathLike[str] | None, written: Path) -> None:
    """Where this process named another folder than ``written`` (the main process's), put its own files there.

    Its own files are its random states and the states of its stateful loaders (what Accelerate has every process
    write); the shared files stay in ``written`` only, as Accelerate writes them on the main process only.
    """
    if requested is None or Path(requested).resolve() == written.resolve():
        return
    folder = Path(requested)
    write_process_files(accelerator, folder)
    save_loader_states(accelerator._dataloaders, folder)
