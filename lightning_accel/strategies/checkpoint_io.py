"""The checkpoint I/O the ``acc_*`` strategies use unless given another: torch's, naming failed files.

Lightning's ``TorchCheckpointIO`` lets torch's error through when a checkpoint file is truncated or corrupt
(``PytorchStreamReader failed reading zip archive``), which does not say which file; this one names it. A local file
is read through :func:`lightning_accel.utils.other.load`: weights-only unless ``weights_only=False`` (which warns
naming the file), and a refusal names the file and the opt-in. A write that meets a full disk, the file size limit or
a quota raises :class:`~lightning_accel.utils.other.CheckpointWriteError` naming the file, not torch's
``unexpected pos``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file
from lightning_accel.utils.other import load, writing

__all__ = ["NamingTorchCheckpointIO", "resolve_weights_only"]


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
