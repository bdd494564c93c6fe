"""A ``save_state`` folder appears complete or not at all.

The processes write into a temporary sibling (``.checkpoint_3.incomplete`` beside ``checkpoint_3``), and only when
every process has finished does the folder get its real name, with one ``rename``. A save killed half-way (even by
SIGKILL) leaves a temporary folder that no loader lists (:func:`~lightning_accel.checkpointing.checkpoint_folders`
matches ``checkpoint_<i>`` only) and that the next save of the same name removes; the previous checkpoints are
untouched, since rotation deletes them only after the rename.

The destination is chosen once, by the main process, and broadcast, so every process writes into the same folder
even if their views of the disk or of the save counter differ.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_accel.checkpointing import checkpoint_folders
from lightning_accel.state.shared_errors import run_where

__all__ = ["SaveTarget", "on_disk_managers", "publish", "remove_stale", "rotate"]

_INCOMPLETE_SUFFIX = ".incomplete"


@dataclass(frozen=True)
class SaveTarget:
    """Where one ``save_state`` writes (``temporary``) and what the folder is called once complete (``final``)."""

    final: Path

    @property
    def temporary(self) -> Path:
        """The hidden sibling written first: ``<parent>/.<name>.incomplete``."""
        return self.final.parent / f".{self.final.name}{_INCOMPLETE_SUFFIX}"


def remove_stale(target: SaveTarget) -> None:
    """Delete what a killed save of the same folder left behind."""
    if target.temporary.is_dir():
        shutil.rmtree(target.temporary)


def publish(target: SaveTarget) -> None:
    """Give the written folder its real name (a no-op where another process of this disk already did).

    A new folder appears with one ``rename``. An existing ``output_dir`` (which may hold files of the user's) is
    updated file by file, each with an atomic ``os.replace``, and the temporary folder removed.
    """
    temporary, final = target.temporary, target.final
    if not temporary.is_dir():
        return
    if final.is_dir():
        _merge(temporary, final)
    else:
        os.rename(temporary, final)
    _fsync_directory(final.parent)


def _merge(source: Path, destination: Path) -> None:
    for entry in source.iterdir():
        moved = destination / entry.name
        if entry.is_dir() and moved.is_dir():
            shutil.rmtree(moved)  # an engine's folder (FSDP/DeepSpeed shards) is replaced whole
        os.replace(entry, moved)
    source.rmdir()


def rotate(root: Path, total_limit: int | None) -> None:
    """Delete the oldest ``checkpoint_<i>`` folders of ``root`` so that ``total_limit`` remain."""
    if total_limit is None:
        return
    folders = checkpoint_folders(root)
    for _, folder in folders[: max(0, len(folders) - total_limit)]:
        shutil.rmtree(folder)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def on_disk_managers(action: Callable[[], None], *, is_main: bool, other_node_manager: bool, what: str) -> None:
    """Run a filesystem ``action`` on the main process, then on the other nodes' local main processes.

    Collective; an error on any of them is raised on every process. The second round keeps node-local disks (with
    ``save_on_each_node``) consistent and finds nothing left to do on shared storage, where the main process acted.
    """
    run_where(is_main, action, what)
    run_where(other_node_manager, action, what)
