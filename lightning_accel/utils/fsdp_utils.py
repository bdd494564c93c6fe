"""Accelerate's ``accelerate.utils.fsdp_utils``: FSDP checkpoints, FSDP2 preparation, and merging shards.

``save_state`` under FSDP with ``SHARDED_STATE_DICT`` writes ``pytorch_model_fsdp_{i}/`` (and ``optimizer_{i}/``) as
``torch.distributed.checkpoint`` directories, one shard per process. :func:`merge_fsdp_weights` turns such a directory
into ``model.safetensors`` (or ``pytorch_model.bin``) that loads without FSDP or a process group.

The model and optimizer checkpoint functions (``save_fsdp_model``, ...) are in
:mod:`lightning_accel.utils.fsdp_checkpoint`, the FSDP2 helpers (``fsdp2_prepare_model``, ...) in
:mod:`lightning_accel.utils.fsdp2_prepare`; both are importable from here, Accelerate's path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_accel.state import PartialState
from lightning_accel.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from lightning_accel.utils.fsdp2_prepare import (
    ensure_weights_retied,
    fsdp2_apply_ac,
    fsdp2_canonicalize_names,
    fsdp2_load_full_state_dict,
    fsdp2_prepare_auto_wrap_policy,
    fsdp2_prepare_model,
    fsdp2_switch_optimizer_parameters,
    get_fsdp2_grad_scaler,
    get_parameters_from_modules,
)
from lightning_accel.utils.fsdp_checkpoint import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from lightning_accel.utils.other import save
from lightning_accel.utils.versions import is_torch_version

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes next to its shards


def enable_fsdp_ram_efficient_loading() -> None:
    """Tell ``transformers`` to load pretrained weights on process 0 only under FSDP (the others get empty ones).

    Sets ``FSDP_CPU_RAM_EFFICIENT_LOADING=True``, and ``ACCELERATE_USE_FSDP=True`` unless it is set: what
    ``transformers.modeling_utils.is_fsdp_enabled`` reads. Accelerate's function, writing ``os.environ``.
    """
    if "ACCELERATE_USE_FSDP" not in os.environ:
        os.environ["ACCELERATE_USE_FSDP"] = "True"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo :func:`enable_fsdp_ram_efficient_loading`'s loading rule: ``FSDP_CPU_RAM_EFFICIENT_LOADING=False``."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def _check_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Fail unless ``checkpoint_dir`` is a ``torch.distributed.checkpoint`` directory, pointing at one inside it.

    Raises:
        ValueError: Naming the model/optimizer directories found inside, if any.

    """
    if (checkpoint_dir / _METADATA).is_file():
        return
    inside = [
        str(checkpoint_dir / name)
        for name in (f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0")
        if (checkpoint_dir / name / _METADATA).is_file()
    ]
    hint = f"; it holds {' and '.join(inside)}: pass one of those instead" if inside else ""
    raise ValueError(
        f"{checkpoint_dir} is not a sharded FSDP checkpoint (no {_METADATA} file from torch.distributed.checkpoint)"
        f"{hint}"
    )


def _load_merged(checkpoint_dir: Path) -> dict[str, Any]:
    """Read every shard of a ``torch.distributed.checkpoint`` directory into one state dict, in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        merged = os.path.join(folder, "merged.pt")
        dcp_to_torch_save(checkpoint_dir, merged)
        state: dict[str, Any] = torch.load(merged, map_location="cpu", weights_only=True)
    if len(state) == 1:  # save_state stores {"model": <state dict>} (or {"optimizer": ...})
        (only,) = state.values()
        if isinstance(only, dict):
            return only
    return state


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge a sharded FSDP checkpoint directory into ``output_path/model.safetensors`` (or ``pytorch_model.bin``).

    The main process does the work (on CPU, holding the whole state dict in memory); the others wait for it.

    Args:
        checkpoint_dir: A ``pytorch_model_fsdp_{i}`` (or ``optimizer_{i}``) directory written by ``save_state`` with
            ``SHARDED_STATE_DICT``.
        output_path: The folder to write to (created if missing).
        safe_serialization: Write ``model.safetensors``; ``False`` writes ``pytorch_model.bin`` with ``torch.save``
            (needed for an optimizer checkpoint, whose nested state safetensors cannot hold).
        remove_checkpoint_dir: Delete ``checkpoint_dir`` after a successful merge.

    Raises:
        ValueError: If ``checkpoint_dir`` is not a ``torch.distributed.checkpoint`` directory, or torch is older
            than 2.3.
        TypeError: If ``safe_serialization`` is asked for a state that is not a flat dict of tensors.

    """
    if not is_torch_version(">=", "2.3.0"):
        raise ValueError("merge_fsdp_weights needs torch 2.3 or newer (torch.distributed.checkpoint.format_utils)")
    source = Path(checkpoint_dir)
    _check_checkpoint_dir(source)
    state = PartialState()
    if state.is_main_process:
        target = Path(output_path)
        target.mkdir(parents=True, exist_ok=True)
        weights = _load_merged(source)
        save(
            weights,
            target / (SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME),
            safe_serialization=safe_serialization,
        )
        if remove_checkpoint_dir:
            shutil.rmtree(source)
    state.wait_for_everyone()
