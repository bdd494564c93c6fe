"""Reading checkpoints written by lightning_accel's sharded strategies without starting processes."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lightning_accel.utils.checkpoint_reads import read_checkpoint_file, strip_prefix
from lightning_accel.utils.deepspeed_checkpoint import consolidate_deepspeed_checkpoint

__all__ = ["METADATA_FILENAME", "is_sharded_checkpoint", "load_full_state_dict", "strip_prefix"]

# A sharded checkpoint is a directory: torch.distributed.checkpoint shards plus this file with everything else.
METADATA_FILENAME = "meta.pt"
_MODEL_KEY = "state_dict"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (shards plus ``meta.pt``)."""
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def load_full_state_dict(path: str | Path, prefix: str = "", key: str = _MODEL_KEY) -> dict[str, torch.Tensor]:
    """Read a model's full state dict from any lightning_accel checkpoint, in one process.

    The weights a checkpoint of one strategy holds load this way into a plain ``nn.Module`` or into a model that
    another strategy then trains (optimizer states are not portable between FSDP and DeepSpeed).

    Args:
        path: A checkpoint file (``FULL_STATE_DICT``, or any Trainer checkpoint), a sharded directory
            (``acc_fsdp`` with ``SHARDED_STATE_DICT``) or a DeepSpeed checkpoint directory (``acc_deepspeed``).
        prefix: Keep only keys starting with this prefix and strip it, e.g. ``"net."`` to load a LightningModule's
            ``self.net`` into a plain ``nn.Module``.
        key: Where the model sits in the checkpoint: ``"state_dict"`` for the Trainer, the name given to
            ``fabric.save(path, {"model": model, ...})`` for Fabric.

    Returns:
        A state dict of plain CPU tensors for ``nn.Module.load_state_dict``.

    """
    path = Path(path)
    if (path / "latest").is_file():  # a DeepSpeed checkpoint directory
        return strip_prefix(consolidate_deepspeed_checkpoint(path), prefix)
    if is_sharded_checkpoint(path):
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        with warnings.catch_warnings():  # torch warns that it reads in one process, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            checkpoint = read_checkpoint_file(path, lambda p: _load_state_dict_from_keys(keys={key}, checkpoint_id=p))
    elif path.is_file():
        checkpoint = read_checkpoint_file(path, lambda p: torch.load(p, map_location="cpu", weights_only=False))
    else:
        raise FileNotFoundError(f"No checkpoint at {str(path)!r}: expected a checkpoint file or directory.")
    if key not in checkpoint:
        raise KeyError(
            f"The checkpoint at {str(path)!r} has no {key!r} entry; pass `key=` (one of {sorted(checkpoint)})."
        )
    return strip_prefix(checkpoint[key], prefix)
