"""Hugging Face's sharded weights files: a state dict split by size, the shards and their index, shared storage.

``save_model`` writes ``model.safetensors`` (or ``pytorch_model.bin``), or ``model-00001-of-00003.safetensors``, ...
with ``model.safetensors.index.json`` past ``max_shard_size``, as ``Accelerator.save_model`` and ``from_pretrained``
expect. :mod:`lightning_accel.checkpointing` re-exports ``save_model`` and ``shard_state_dict``;
:mod:`lightning_accel.checkpoint.state_files` reads weights with the key helpers (one name per shared storage, a
wrapper's ``module.`` prefix).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_accel.utils.constants import MODEL_NAME, SAFE_MODEL_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME
from lightning_accel.utils.other import safetensors_save, torch_save

__all__ = ["match_wrapper_prefix", "save_model", "shard_state_dict", "without_shared_storage"]

_WRAPPER_PREFIX = "module."

_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_SHARD_FILE = re.compile(r".*-\d{5}-of-\d{5}")


def _size_in_bytes(size: int | str) -> int:
    """``"10GB"`` -> ``10 * 10**9`` (decimal units, as Hugging Face uses); ints are bytes."""
    if isinstance(size, int):
        return size
    text = size.strip()
    unit = text[-2:].upper()
    try:
        return int(float(text[:-2]) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"max_shard_size={size!r} is not a size; use bytes or e.g. '10GB', '500MB', '1KB'.") from None


def shard_state_dict(
    state: Mapping[str, torch.Tensor], pattern: str, max_shard_size: int | str
) -> dict[str, list[str]]:
    """Split ``state`` into files of at most ``max_shard_size`` bytes, as Hugging Face Hub names and fills them.

    Tensors are taken in order and a new shard starts when the next tensor would overflow the current one; a tensor
    larger than the limit gets a shard of its own. One shard is named ``pattern.format(suffix="")``, several
    ``pattern.format(suffix="-00001-of-00003")``, ...

    Returns:
        File name -> tensor names, in order.

    """
    limit = _size_in_bytes(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if size > limit:
            shards.append([name])
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {pattern.format(suffix=""): shards[0] if shards else []}
    return {pattern.format(suffix=f"-{i + 1:05d}-of-{len(shards):05d}"): names for i, names in enumerate(shards)}


def without_shared_storage(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the first name only of tensors that share storage (safetensors refuses shared tensors)."""
    seen: set[tuple[int, int]] = set()
    kept = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key in seen and tensor.numel() > 0:
            continue
        seen.add(key)
        kept[name] = tensor
    return kept


def save_model(
    state: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    is_main_process: bool = True,
) -> None:
    """Write ``state`` as ``model.safetensors`` (or ``pytorch_model.bin``), sharded with an index past the limit.

    Stale shard files of an earlier save in ``save_directory`` are removed, and existing files replaced, only once
    every new file is completely written.

    Raises:
        ValueError: If ``save_directory`` is a file, or ``max_shard_size`` is not a size.

    """
    directory = Path(save_directory)
    if directory.is_file():
        raise ValueError(f"save_model needs a directory, but {directory} is a file.")
    if not is_main_process:
        return
    directory.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        state = without_shared_storage(state)
    pattern = f"{SAFE_MODEL_NAME}{{suffix}}.safetensors" if safe_serialization else f"{MODEL_NAME}{{suffix}}.bin"
    shards = shard_state_dict(state, pattern, max_shard_size)
    # Every new file is written under a temporary name first, and old files are replaced or removed only once all
    # of them are complete: a save killed midway leaves the previous save intact.
    written = [_write_shard(directory, filename, {n: state[n] for n in names}, safe_serialization)
               for filename, names in shards.items()]  # fmt: skip
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, names in shards.items() for n in names}}
        index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
        temporary = directory / f".{index_name}.partial"
        temporary.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append((temporary, directory / index_name))
    for temporary, final in written:
        os.replace(temporary, final)
    stem = pattern.split("{")[0]
    for old in directory.iterdir():
        stale = old.is_file() and old.name.startswith(stem) and old.name not in shards
        if stale and _SHARD_FILE.fullmatch(old.name.rsplit(".", 1)[0]):
            old.unlink()


def _write_shard(
    directory: Path, filename: str, shard: Mapping[str, torch.Tensor], safe_serialization: bool
) -> tuple[Path, Path]:
    """Write one shard under a temporary name in ``directory``; returns that name and the final one."""
    temporary = directory / f".{filename}.partial"
    if safe_serialization:
        safetensors_save({k: v.detach().cpu().contiguous() for k, v in shard.items()}, temporary)
    else:
        torch_save(dict(shard), temporary)
    return temporary, directory / filename


def match_wrapper_prefix(state: Mapping[str, Any], expected: Any) -> dict[str, Any]:
    """``state`` with a wrapper's ``module.`` prefix added or stripped to match the ``expected`` keys.

    For weights saved from a wrapped (DDP) model by other tools, or loaded into one; other states are returned as
    they are.
    """
    keys = set(expected)
    if set(state) == keys:
        return dict(state)
    if all(k.startswith(_WRAPPER_PREFIX) for k in keys):
        return {f"{_WRAPPER_PREFIX}{k}": v for k, v in state.items()}
    if all(k.startswith(_WRAPPER_PREFIX) for k in state):
        return {k[len(_WRAPPER_PREFIX) :]: v for k, v in state.items()}
    return dict(state)
