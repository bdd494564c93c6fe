"""DeepSpeed checkpoints as one full state dict: ``pytorch_model.bin``, ZeRO shards merged, or stage 0's module file.

Runs in a single process without a strategy (``deepspeed`` is imported only to merge ZeRO shards).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from lightning_accel.utils.checkpoint_reads import read_checkpoint_file, strip_prefix
from lightning_accel.utils.constants import WEIGHTS_NAME

__all__ = ["consolidate_deepspeed_checkpoint"]


def consolidate_deepspeed_checkpoint(
    path: str | os.PathLike[str], tag: str | None = None, prefix: str = ""
) -> dict[str, Tensor]:
    """Turn a DeepSpeed checkpoint directory into one full state dict for a plain ``nn.Module``.

    Works in a single process, without the strategy. It reads ``pytorch_model.bin`` when the checkpoint has one
    (written with ``zero3_save_16bit_model=True``; it holds the weights in the training dtype), and otherwise
    merges the ZeRO shards into fp32 weights with DeepSpeed's ``zero_to_fp32`` utilities.

    Args:
        path: The directory ``trainer.save_checkpoint`` (or ``fabric.save``) wrote.
        tag: The DeepSpeed tag (sub-directory) to read; by default the one named in the ``latest`` file.
        prefix: Keep only the keys starting with this prefix and strip it, e.g. ``"net."`` to load a
            LightningModule's ``self.net`` into a plain module.

    Returns:
        Parameter and buffer names of the trained module (the LightningModule for the Trainer) mapped to tensors.

    Raises:
        FileNotFoundError: If ``path`` is not a DeepSpeed checkpoint directory.
        KeyError: If no key starts with ``prefix``.

    """
    return strip_prefix(_read_deepspeed_checkpoint(Path(path), tag), prefix)


def _read_deepspeed_checkpoint(root: Path, tag: str | None) -> dict[str, Tensor]:
    full = root / WEIGHTS_NAME
    if full.is_file() and tag is None:
        return dict(read_checkpoint_file(full, lambda p: torch.load(p, map_location="cpu", weights_only=True)))
    if not (root / "latest").is_file() and tag is None:
        raise FileNotFoundError(
            f"{root} is not a DeepSpeed checkpoint directory (it has neither {WEIGHTS_NAME} nor a 'latest' file)."
            " Pass the directory that trainer.save_checkpoint wrote."
        )
    tag = tag if tag is not None else (root / "latest").read_text().strip()
    shard_dir = root / tag
    if not any("zero_pp_rank" in f.name for f in shard_dir.glob("*optim_states.pt")):
        return _stage0_state_dict(shard_dir)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(
        read_checkpoint_file(shard_dir, lambda _: get_fp32_state_dict_from_zero_checkpoint(os.fspath(root), tag=tag))
    )


def _stage0_state_dict(shard_dir: Path) -> dict[str, Tensor]:
    """Without ZeRO, rank 0's model-states file holds the whole module."""
    files = sorted(shard_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"No DeepSpeed model-states file in {shard_dir}.")
    state = read_checkpoint_file(files[0], lambda p: torch.load(p, map_location="cpu", weights_only=False))
    return dict(state["module"])
