"""Accelerate's ``save`` and ``load``: write once per run (or node), read with ``weights_only`` safety."""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_accel.state import PartialState

__all__ = ["load", "save"]


def save(
    obj: Any, f: str | os.PathLike[str], save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """Save ``obj`` from the main process only (or each node's main process with ``save_on_each_node``).

    Args:
        obj: What to save; with ``safe_serialization``, a dict of tensors.
        f: The destination file.
        save_on_each_node: Write on every node's main process (for node-local disks).
        safe_serialization: Write safetensors (metadata ``{"format": "pt"}``) instead of ``torch.save``.

    Raises:
        TypeError: If ``safe_serialization`` is asked for something other than a dict of tensors.

    """
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise TypeError(
            f"safe_serialization=True saves a dict of tensors, got {type(obj).__name__}; pass"
            " safe_serialization=False to pickle other objects."
        )
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in obj.items()}, os.fspath(f), metadata={"format": "pt"})


def load(f: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller passes ``weights_only=False``."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)
