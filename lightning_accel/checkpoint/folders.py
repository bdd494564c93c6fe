"""A checkpoint (folder or file) appears complete or not at all: the one atomic publishing protocol.

Used by ``Accelerator.save_state`` and by :class:`~lightning_accel.callbacks.CheckpointRotation`. The processes write
into a temporary sibling (``.checkpoint_3.incomplete`` beside ``checkpoint_3``), and only when every process has
finished does it get its real name, with one ``rename``. A save killed half-way (even by SIGKILL) leaves a temporary
entry that no loader lists (:func:`numbered_checkpoints` matches ``checkpoint_<i>`` only) and that the next save
removes; the previous checkpoints are untouched, since rotation deletes them only after the rename.

Where every process holds a shard of the state (FSDP, DeepSpeed), the destination is chosen once, by the main
process, and broadcast, so every process writes into the same folder even if their views of the disk or of the save
counter differ. With ``save_on_each_node`` each node's disk is published by its own local main process
(:func:`on_disk_managers`); :mod:`lightning_accel.checkpoint.node_copies` first completes each node's temporary
folder.

Where the state is replicated (one device, DDP), a save may come from one process alone (as Accelerate allows:
``if accelerator.is_main_process: accelerator.save_state(...)``), so nothing waits for another process: the process
that writes the shared files publishes the folder by itself, and every other process that saves puts its own files
into a staging sibling (:func:`stage`, ``.checkpoint_3.process_1.incomplete``), which it hands in once the
checkpoint exists, or which the publisher takes in when it publishes (:func:`publish`). Whichever of the two comes
second finds the other's work done, so no file is lost and nobody waits.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_accel.state.shared_errors import run_where
from lightning_accel.utils.other import write_error

__all__ = [
    "SaveTarget",
    "abandon_on_error",
    "move_into_place",
    "numbered_checkpoints",
    "on_disk_managers",
    "publish",
    "remove_entry",
    "remove_incomplete",
    "remove_stale",
    "rotate",
    "stage",
]

_INCOMPLETE_SUFFIX = ".incomplete"
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
_INCOMPLETE = re.compile(r"^\.checkpoint_(\d+)(\.(process|publisher)_\d+)?\.incomplete(\.writing)?$")
_DEFAULTS = "defaults"  # a staged subfolder: files that never replace the publisher's


@dataclass(frozen=True)
class SaveTarget:
    """Where one save writes (``temporary``) and what the checkpoint is called once complete (``final``)."""

    final: Path
    publisher: int = 0  # the process index of another node's publisher (save_on_each_node, replicated state)

    @property
    def temporary(self) -> Path:
        """The hidden sibling written first: ``<parent>/.<name>.incomplete`` (``.<name>.publisher_<i>.incomplete``)."""
        own = f".publisher_{self.publisher}" if self.publisher else ""
        return self.final.parent / f".{self.final.name}{own}{_INCOMPLETE_SUFFIX}"

    def staging(self, process_index: int) -> Path:
        """Where another process's own files wait for the checkpoint: ``<parent>/.<name>.process_<i>.incomplete``."""
        return self.final.parent / f".{self.final.name}.process_{process_index}{_INCOMPLETE_SUFFIX}"

    def staged(self) -> list[Path]:
        """The staging siblings that processes have finished writing (see :func:`stage`)."""
        pattern = f".{self.final.name}.process_*{_INCOMPLETE_SUFFIX}"
        return sorted(path for path in self.final.parent.glob(pattern) if path.is_dir())


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


@contextlib.contextmanager
def abandon_on_error(folder: Path) -> Iterator[None]:
    """Remove ``folder`` (a save's temporary folder) when its writing fails, and re-raise.

    A full disk, the file size limit or a quota is raised as
    :class:`~lightning_accel.utils.other.CheckpointWriteError` naming the file written last; the checkpoints
    already published stay what resume and rotation see.
    """
    try:
        yield
    except Exception as error:
        named = write_error(error, folder)  # before the removal: it names the file written last
        shutil.rmtree(folder, ignore_errors=True)
        if named is None or named is error:
            raise
        raise named from error


def publish(target: SaveTarget) -> None:
    """Give the written checkpoint its real name (a no-op where another process of this disk already did).

    A new checkpoint appears with one ``rename``. An existing folder (an ``output_dir`` that may hold files of the
    user's) is updated entry by entry, each with an atomic ``os.replace``, and the temporary folder removed.
    Then the files other processes staged for this checkpoint (:func:`stage`) are taken in.
    """
    temporary, final = target.temporary, target.final
    if temporary.exists():
        if temporary.is_dir() and final.is_dir():
            _merge(temporary, final)
        else:
            try:
                os.rename(temporary, final)
            except OSError:  # another publisher of this disk named it first (save_on_each_node on shared storage)
                if not (temporary.is_dir() and final.is_dir()):
                    raise
                _merge(temporary, final)
    if final.is_dir():
        for staged in target.staged():
            _hand_in(staged, final)
    _fsync(final.parent)


def stage(
    target: SaveTarget, process_index: int, own: Callable[[Path], None], defaults: Callable[[Path], None]
) -> None:
    """Save a process's files for a checkpoint that another process publishes, without waiting for it.

    ``own(folder)`` writes the files that belong to this process alone (its random states): they replace any file of
    that name. ``defaults(folder)`` writes files the publisher may write too (a loader's state): they are kept only
    where the checkpoint has none, so on shared storage the publisher's stay. The files are written into a hidden
    folder, which becomes the staging sibling with one ``rename``; if the checkpoint is published already they are
    handed in at once, else the publisher takes them in (:func:`publish`).
    """
    staged = target.staging(process_index)
    writing = staged.with_name(staged.name + ".writing")
    for leftover in (writing, staged):
        if leftover.exists():
            remove_entry(leftover)
    with abandon_on_error(writing):
        (writing / _DEFAULTS).mkdir(parents=True)
        own(writing)
        defaults(writing / _DEFAULTS)
    os.rename(writing, staged)
    if target.final.is_dir():
        _hand_in(staged, target.final)


def _hand_in(staged: Path, final: Path) -> None:
    """Move a staging folder's files into the published checkpoint (a no-op for files another process moved)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(staged.iterdir()):
            if entry.name != _DEFAULTS:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(entry, final / entry.name)
        for entry in sorted((staged / _DEFAULTS).iterdir()):
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                os.link(entry, final / entry.name)  # never replaces the publisher's file of that name
        shutil.rmtree(staged, ignore_errors=True)


def _merge(source: Path, destination: Path) -> None:
    for entry in source.iterdir():
        moved = destination / entry.name
        if entry.is_dir() and moved.is_dir():
            shutil.rmtree(moved)  # an engine's folder (FSDP/DeepSpeed shards) is replaced whole
        os.replace(entry, moved)
    source.rmdir()


def rotate(root: Path, total_limit: int | None, *, folders_only: bool = True) -> None:
    """Delete the oldest ``checkpoint_<i>`` entries of ``root`` so that ``total_limit`` remain.

    Before anything is deleted, the newest checkpoint's files are written through to the disk (:func:`make_durable`):
    a save returns once its files are in the page cache, and a crash before the kernel writes them back would
    otherwise leave a torn newest checkpoint and no older one.
    """
    if total_limit is None:
        return
    found = numbered_checkpoints(root, folders_only=folders_only)
    doomed = found[: max(0, len(found) - total_limit)]
    if doomed and len(doomed) < len(found):
        make_durable(found[-1][1])
    for _, entry in doomed:
        remove_entry(entry)


def make_durable(entry: Path) -> None:
    """``fsync`` a checkpoint file, or every file and folder of a checkpoint folder (symbolic links followed)."""
    if not entry.is_dir():
        _fsync(entry)
        return
    for folder, _, files in os.walk(entry, followlinks=True):
        for name in files:
            _fsync(Path(folder, name))
        _fsync(Path(folder))


def move_into_place(written: Path, final: Path) -> None:
    """Give ``written`` (a complete file or folder) the name ``final``, durably.

    One ``rename``; over an existing folder, entry by entry (each an atomic ``os.replace``), ``written`` removed.
    """
    if written.is_dir() and final.is_dir():
        _merge(written, final)
    else:
        os.rename(written, final)
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    """Write ``path``'s data (a file's contents, a folder's entries) through to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
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
