"""A checkpoint (folder or file) appears complete or not at all: the one atomic publishing protocol.

Used by ``Accelerator.save_state`` and by :class:`~lightning_accel.callbacks.CheckpointRotation`. The processes write
into a temporary sibling (``.checkpoint_3.incomplete`` beside ``checkpoint_3``), and only when every process has
finished does it get its real name, with one ``rename``. A save killed half-way (even by SIGKILL) leaves a temporary
entry that no loader lists (:func:`numbered_checkpoints` matches ``checkpoint_<i>`` only) and that the next save
removes; the previous checkpoints are untouched, since rotation deletes them only after the rename.

The destination is chosen once, by the main process, and broadcast, so every process writes into the same folder
even if their views of the disk or of the save counter differ. With ``save_on_each_node`` each node's disk is
published by its own local main process (:func:`on_disk_managers`); :mod:`lightning_accel.checkpoint.node_copies`
first completes each node's temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_accel.state.shared_errors import run_where

__all__ = [
    "SaveTarget",
    "numbered_checkpoints",
    "on_disk_managers",
    "publish",
    "remove_entry",
    "remove_incomplete",
    "remove_stale",
    "rotate",
]

_INCOMPLETE_SUFFIX = ".incomplete"
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
_INCOMPLETE = re.compile(r"^\.checkpoint_(\d+)\.incomplete$")


@dataclass(frozen=True)
class SaveTarget:
    """Where one save writes (``temporary``) and what the checkpoint is called once complete (``final``)."""

    final: Path

    @property
    def temporary(self) -> Path:
        """The hidden sibling written first: ``<parent>/.<name>.incomplete``."""
        return self.final.parent / f".{self.final.name}{_INCOMPLETE_SUFFIX}"


def numbered_checkpoints(root: str | os.PathLike[str], *, folders_only: bool = True) -> list[tuple[int, Path]]:
    """The complete ``checkpoint_<i>`` entries of ``root``, oldest (smallest ``i``) first.

    Args:
        root: The folder holding the checkpoints.
        folders_only: List folders only (``save_state``'s); ``False`` also lists files (a Trainer checkpoint).

    """
    directory = Path(root)
    if not directory.is_dir():
        return []
    found = [
        (int(match[1]), entry)
        for entry in directory.iterdir()
        if (match := _NUMBERED.match(entry.name)) and (entry.is_dir() or not folders_only)
    ]
    return sorted(found)


def remove_entry(entry: Path) -> None:
    """Delete a checkpoint file or folder (a symbolic link itself, not what it points to)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def remove_stale(target: SaveTarget) -> None:
    """Delete what a killed save of the same checkpoint left behind."""
    if target.temporary.exists() or target.temporary.is_symlink():
        remove_entry(target.temporary)


def remove_incomplete(root: Path) -> None:
    """Delete every ``.checkpoint_<i>.incomplete`` entry of ``root`` (saves that were killed)."""
    if root.is_dir():
        for entry in root.iterdir():
            if _INCOMPLETE.match(entry.name):
                remove_entry(entry)


def publish(target: SaveTarget) -> None:
    """Give the written checkpoint its real name (a no-op where another process of this disk already did).

    A new checkpoint appears with one ``rename``. An existing folder (an ``output_dir`` that may hold files of the
    user's) is updated entry by entry, each with an atomic ``os.replace``, and the temporary folder removed.
    """
    temporary, final = target.temporary, target.final
    if not temporary.exists():
        return
    if temporary.is_dir() and final.is_dir():
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


def rotate(root: Path, total_limit: int | None, *, folders_only: bool = True) -> None:
    """Delete the oldest ``checkpoint_<i>`` entries of ``root`` so that ``total_limit`` remain."""
    if total_limit is None:
        return
    found = numbered_checkpoints(root, folders_only=folders_only)
    for _, entry in found[: max(0, len(found) - total_limit)]:
        remove_entry(entry)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def on_disk_managers(
    action: Callable[[], None],
    *,
    is_main: bool,
    other_node_manager: bool,
    what: str,
    barrier: Callable[[], None] | None = None,
) -> None:
    """Run a filesystem ``action`` on the main process, then on the other nodes' local main processes.

    Collective; an error on any of them is raised on every process. The second round keeps node-local disks (with
    ``save_on_each_node``) consistent and finds nothing left to do on shared storage, where the main process acted.

    Args:
        action: The filesystem work.
        is_main: Whether this is the global main process.
        other_node_manager: Whether this process manages another node's disk (``save_on_each_node``, local rank 0,
            not the global main process).
        what: What the work is, for the error's note.
        barrier: The strategy's barrier, where processes are synchronised by other means than a
            ``torch.distributed`` group (see :func:`~lightning_accel.state.shared_errors.run_where`).

    """
    run_where(is_main, action, what, barrier)
    run_where(other_node_manager, action, what, barrier)
