"""The checkpoint I/O the ``acc_*`` strategies use unless given another: torch's, naming failed files.

Lightning's ``TorchCheckpointIO`` lets torch's error through when a checkpoint file is truncated or corrupt
(``PytorchStreamReader failed reading zip archive``), which does not say which file; this one names it. A local file
is read through :func:`lightning_accel.utils.other.load`: weights-only unless ``weights_only=False`` (which warns
naming the file), and a refusal names the file and the opt-in. A write that meets a full disk, the file size limit or
a quota raises :class:`~lightning_accel.utils.other.CheckpointWriteError` naming the file, not torch's
``unexpected pos``.

:class:`AsyncNamingCheckpointIO` writes the same files in a background thread (``plugins=[AsyncNamingCheckpointIO()]``
on a ``Trainer`` or ``Fabric`` with an ``acc_*`` strategy): each file is published under its name only once it is
complete, the checkpoint it replaces is removed only after that, and an error of the thread is raised by the next
save, load or teardown.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from typing_extensions import override

from lightning_accel.checkpoint.background import BackgroundSave, HostBuffers, host_copy
from lightning_accel.checkpoint.folders import move_into_place
from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file
from lightning_accel.utils.other import CheckpointWriteError, load, writing

__all__ = [
    "AsyncNamingCheckpointIO",
    "NamingTorchCheckpointIO",
    "refuse_async_checkpoint_io",
    "resolve_weights_only",
    "wait_for_background_save",
    "writing_path",
]

_log = logging.getLogger(__name__)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """Lightning's ``weights_only`` argument as this package reads it: only an explicit ``False`` opts out."""
    return weights_only is not False


class NamingTorchCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose reads are weights-only by default and raise ``ValueError`` naming a bad file."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` as Lightning's does.

        Raises:
            CheckpointWriteError: (an ``OSError``) On a full disk, the file size limit or a quota, naming the file.

        """
        with writing(Path(path)):
            super().save_checkpoint(checkpoint, path, storage_options)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read ``path``; a remote one (``s3://``, ``http...``) through Lightning's loader, weights-only too.

        Raises:
            FileNotFoundError: If there is no file at ``path``.
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses the file.
            ValueError: If the file cannot be read, naming it.

        """
        safe = resolve_weights_only(weights_only)
        if "://" in str(path):
            parent = super().load_checkpoint
            return read_checkpoint_file(path, lambda p: parent(p, map_location=map_location, weights_only=safe))
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return read_checkpoint_file(path, lambda p: load(p, map_location=map_location, weights_only=safe))


def writing_path(path: Path) -> Path:
    """The hidden sibling a background write fills before it is renamed to ``path``: ``.<name>.writing``.

    ``CheckpointRotation``'s ``.checkpoint_<i>.incomplete`` becomes ``.checkpoint_<i>.incomplete.writing``, which the
    rotation's clean-up of killed saves removes.
    """
    hidden = path.name if path.name.startswith(".") else f".{path.name}"
    return path.with_name(f"{hidden}.writing")


class AsyncNamingCheckpointIO(_WrappingCheckpointIO):
    """Write checkpoints in a background thread, published only when complete, through another ``CheckpointIO``.

    ``save_checkpoint`` copies the checkpoint into host memory on the caller's thread (every tensor once per storage,
    so tied weights stay tied and the file holds what a synchronous save writes) and returns; a thread writes it with
    the wrapped I/O into a hidden sibling (``.<name>.writing``) and renames it to its name once complete. Training
    may change the weights meanwhile: the file holds the state at the call. What differs from Lightning's
    ``AsyncCheckpointIO``, on purpose:

    * ``remove_checkpoint`` waits for the pending save: ``ModelCheckpoint`` removes the previous best or last file
      only after the new one landed, and never when the new one failed, so a process killed during the write
      (even SIGKILL) leaves the previous checkpoint on disk, the one ``ckpt_path="last"`` resumes from;
    * a failed write is raised by the next ``save_checkpoint``, ``load_checkpoint``, :meth:`wait` or ``teardown``
      (the Trainer's end of ``fit``), before anything else is written, naming the file;
    * at most one save is pending: the next one waits for it, so saves never pile up in memory;
    * :meth:`then` queues what must follow the pending save (``CheckpointRotation`` renames and rotates there).

    Only the process that writes (global rank 0 for DDP) has a pending save: the ``acc_*`` strategies' loads (every
    process) wait for it and meet at a barrier before reading (:func:`wait_for_background_save`); another reader
    right after a save must do the same (``checkpoint_io.wait()`` on rank 0, then a barrier). A Fabric script
    should call ``fabric.strategy.checkpoint_io.teardown()`` at its end to be told of an error of the last save (the
    interpreter still waits for that write before it exits). ``acc_fsdp`` with ``SHARDED_STATE_DICT`` writes its
    directory with torch's ``dcp.async_save`` and hands it to :meth:`hold`: the directory is published once every
    process wrote its shards, in the next save (or load, or ``teardown``) of the strategy, which every process makes.
    ``acc_deepspeed``'s engine writes its folder itself: it refuses this plugin (see
    :func:`refuse_async_checkpoint_io`).

    Args:
        checkpoint_io: The I/O that writes each file (in the thread) and reads them; by default
            :class:`NamingTorchCheckpointIO`.

    Example:
        >>> trainer = Trainer(strategy="acc_ddp", plugins=[AsyncNamingCheckpointIO()])  # doctest: +SKIP

    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(NamingTorchCheckpointIO() if checkpoint_io is None else checkpoint_io)
        self._pending: BackgroundSave | None = None
        self._buffers = HostBuffers()  # the last save's host memory, copied into by the next (its write is done)
        atexit.register(_report_at_exit, weakref.ref(self))

    @property
    def _base(self) -> CheckpointIO:
        assert self.checkpoint_io is not None  # set in __init__
        return self.checkpoint_io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        """Wait for the pending save, copy ``checkpoint`` into host memory and write it to ``path`` in the thread.

        Raises:
            CheckpointWriteError: (an ``OSError``) If the pending save met a full disk, the file size limit or a
                quota, naming its file; other errors of the pending save as they were raised.

        """
        self.wait()
        write, publish = self._writer(host_copy(checkpoint, self._buffers), path, storage_options)
        self._pending = BackgroundSave(write, publish, together=False, what=str(path), daemon=False)

    def _writer(
        self, staged: dict[str, Any], path: str | Path, storage_options: Any | None
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        """What the thread runs: write ``staged`` into the hidden sibling of ``path``, then rename it to ``path``."""
        base = self._base
        if "://" in str(path):  # remote storage: the wrapped I/O publishes
            return (lambda: base.save_checkpoint(staged, path, storage_options)), (lambda: None)
        final = Path(path)
        writing = writing_path(final)

        def write() -> None:
            try:
                base.save_checkpoint(staged, writing, storage_options)
            except CheckpointWriteError as error:  # named by the file it was to become
                raise CheckpointWriteError(error.code, final) from error

        return write, lambda: move_into_place(writing, final)

    def hold(self, save: BackgroundSave) -> None:
        """Make ``save``, started by a strategy's engine (an FSDP sharded directory), the pending save.

        It is then waited for, and followed by what :meth:`then` queues, like one written here. A save that every
        process makes together is finished collectively: every process must then call the next ``save_checkpoint``
        of its strategy, :meth:`wait` or ``teardown``.

        Raises:
            RuntimeError: If a save is pending: :meth:`wait` for it first (before starting ``save``).

        """
        if self._pending is not None:
            raise RuntimeError(
                f"AsyncNamingCheckpointIO.hold: the save of {self._pending.what} is pending; wait() first."
            )
        self._pending = save

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the pending save has landed (in the writer thread), or now if none is pending.

        The action is dropped if the pending save fails; its own error is raised like a failed write's.
        """
        if self._pending is None:
            action()
        else:
            self._pending.then(action)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        """Remove ``path`` once the pending save has landed; never if it fails."""
        base = self._base
        self.then(lambda: base.remove_checkpoint(path))

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Wait for the pending save, then read through the wrapped I/O."""
        self.wait()
        return self._base.load_checkpoint(*args, **kwargs)

    def wait(self) -> None:
        """Block until the pending save (and what :meth:`then` queued) is done.

        Raises:
            BaseException: What the pending save or a queued action raised (once).

        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    @override
    def teardown(self) -> None:
        """Wait for the pending save, give the host memory of the copies back, then tear the wrapped I/O down.

        Raises:
            BaseException: What the pending save raised.

        """
        self.wait()
        self._buffers.release()
        self._base.teardown()


def _report_at_exit(reference: weakref.ref[AsyncNamingCheckpointIO]) -> None:
    io = reference()
    if io is None or io._pending is None:
        return
    if io._pending.together:  # its finish is a collective, which the other processes are not in now
        _log.error(
            "AsyncNamingCheckpointIO: the background save of %s was never published; call"
            " strategy.checkpoint_io.teardown() on every process before the script ends.",
            io._pending.what,
        )
        return
    try:
        io.wait()
    except BaseException:
        _log.exception("AsyncNamingCheckpointIO: the last background checkpoint save failed")


def wait_for_background_save(checkpoint_io: CheckpointIO, barrier: Callable[[], None]) -> None:
    """Before a load that every process makes: finish the pending background save, then meet the other processes.

    Only the writing process (global rank 0, or all for a sharded directory) has the save pending; the barrier keeps
    the others from reading the file before it landed.
    """
    if isinstance(checkpoint_io, AsyncNamingCheckpointIO):
        checkpoint_io.wait()
        barrier()


def refuse_async_checkpoint_io(checkpoint_io: CheckpointIO, what: str, fix: str) -> None:
    """Refuse an asynchronous ``CheckpointIO`` where ``what`` is written by an engine that does not use it.

    Args:
        checkpoint_io: The strategy's checkpoint I/O.
        what: The checkpoint that would not be asynchronous, e.g. ``"acc_deepspeed's checkpoint folder"``.
        fix: What to do instead.

    Raises:
        ValueError: If ``checkpoint_io`` is :class:`AsyncNamingCheckpointIO` or Lightning's ``AsyncCheckpointIO``.

    """
    if isinstance(checkpoint_io, (AsyncNamingCheckpointIO, AsyncCheckpointIO)):
        raise ValueError(
            f"{type(checkpoint_io).__name__} cannot save {what} in the background: the engine writes it itself, not"
            f" through a CheckpointIO, so the save would silently be synchronous. {fix}"
        )
