"""The checkpoint I/O the ``acc_*`` strategies read files with unless given another: torch's, naming failed files.

Lightning's ``TorchCheckpointIO`` lets torch's error through when a checkpoint file is truncated or corrupt
(``PytorchStreamReader failed reading zip archive``), which does not say which file; this one names it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file

__all__ = ["NamingTorchCheckpointIO"]


class NamingTorchCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose reads raise ``ValueError`` naming the file when it cannot be read."""

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        parent = super().load_checkpoint
        return read_checkpoint_file(path, lambda p: parent(p, map_location=map_location, weights_only=weights_only))
