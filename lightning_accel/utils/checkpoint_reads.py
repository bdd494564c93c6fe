"""Reading checkpoint files so that a failure names the file: torch's and safetensors' errors do not.

Every read of a checkpoint (the shim's ``load_state``, the strategies' ``load_checkpoint``, the big-model loaders)
goes through :func:`read_checkpoint_file`, so a truncated or corrupt file, or one that is not a checkpoint, is
reported as ``ValueError`` naming its path instead of torch's ``PytorchStreamReader failed reading zip archive``.
:func:`strip_prefix` selects one submodule's entries of a state dict that was read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = ["read_checkpoint_file", "strip_prefix"]

T = TypeVar("T")
V = TypeVar("V")
P = TypeVar("P", bound="str | os.PathLike[str]")


def read_checkpoint_file(path: P, reader: Callable[[P], T]) -> T:
    """``reader(path)``, with any failure but a missing file re-raised naming ``path``.

    Raises:
        FileNotFoundError: If ``path`` does not exist (as the reader raised it).
        ValueError: If the reader failed on the file's content, naming the file and the reader's reason.

    """
    try:
        return reader(path)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise ValueError(
            f"Could not read checkpoint file {path}: {str(err).rstrip('.')}. The file may be truncated or corrupt "
            "(a save that was interrupted, a partial copy) or not a checkpoint; point to an intact checkpoint."
        ) from err


def strip_prefix(state: Mapping[str, V], prefix: str) -> dict[str, V]:
    """Keep the entries whose key starts with ``prefix``, without it (all entries for an empty prefix).

    Raises:
        KeyError: If no key starts with ``prefix``.

    """
    if not prefix:
        return dict(state)
    selected = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        raise KeyError(f"No key of the checkpoint starts with prefix {prefix!r}; keys look like {next(iter(state))!r}.")
    return selected
