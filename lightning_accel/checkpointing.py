"""``save_state`` / ``load_state`` with Accelerate 1.15's folder and file names, so checkpoints are interchangeable.

A checkpoint folder holds ``model.safetensors`` (``model_1.safetensors``, ... or ``pytorch_model.bin`` without safe
serialization), ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt`` (fp16 with a gradient scaler),
``random_states_{rank}.pkl`` (one per process), ``custom_checkpoint_{i}.pkl`` (registered objects) and, with
``use_stateful_dataloader``, ``dl_state_dict.bin`` (``dl_state_dict_{i}.bin``; see
:mod:`lightning_accel.checkpoint.loader_states`). Model weights are the user's module's state dict (no DDP ``module.``
prefix), as Accelerate writes them.

Differences from Accelerate (its bugs, fixed):

- ``load_state`` restores the save counter, so the next automatically named save does not collide with an existing
  ``checkpoint_N`` (Accelerate restarts at ``checkpoint_0`` and raises).
- Rotation (``total_limit``) deletes old folders only after the new checkpoint is written.
- ``save_state(output_dir)`` with automatic naming on raises instead of ignoring ``output_dir``.
- An unreadable (e.g. truncated) file raises an error naming the file.
- ``load_state`` restores the epoch and position of each prepared data loader (extra keys of
  ``random_states_{rank}.pkl``), so a resumed run continues with the next batch of the right epoch instead of
  replaying epoch 0 (exact with the seedable sampler, whose order depends only on the epoch).

Under FSDP and DeepSpeed the engine writes the models and optimizers itself, under Accelerate's names too
(``pytorch_model_fsdp_0/`` and ``optimizer_0/``, ``pytorch_model_fsdp.bin`` and ``optimizer.bin``, or DeepSpeed's
``pytorch_model/``): see :mod:`lightning_accel.checkpoint.fsdp_layout` and :mod:`lightning_accel.checkpoint.engines`.
As in Accelerate, the save hooks then get no weights and the load hooks no models.

Accelerate's lower-level functions, with its signatures: :func:`save_accelerator_state` / :func:`load_accelerator_state`
(given state dicts, optimizers, schedulers, loaders, a scaler and the RNG states) and :func:`save_custom_state` /
:func:`load_custom_state` (one registered object). Every file is written and read by one implementation, in
:mod:`lightning_accel.checkpoint.state_files`, whose functions take explicit arguments: this module and
``Accelerator.save_state``/``load_state`` gather the arguments and call them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_accel.checkpoint.folders import numbered_checkpoints
from lightning_accel.checkpoint.state_files import (
    Stateful,
    custom_file,
    is_main_writer,
    load_custom_file,
    load_loader_files,
    load_model_weights,
    load_process_states,
    load_scaler,
    load_state_dicts,
    write_process_states,
    write_shared_files,
)
from lightning_accel.checkpoint.weight_shards import save_model, shard_state_dict
from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState
from lightning_accel.utils.constants import OPTIMIZER_NAME, SCHEDULER_NAME
from lightning_accel.utils.other import get_pretty_name, save

__all__ = [
    "accelerate_sampler",
    "checkpoint_folders",
    "load_accelerator_state",
    "load_custom_state",
    "load_state",
    "save_accelerator_state",
    "save_custom_state",
    "save_model",
    "save_state",
    "shard_state_dict",
]

logger = get_logger(__name__)


class _StateOwner(Protocol):
    """What :func:`save_state` and :func:`load_state` call: an ``Accelerator``."""

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Write a checkpoint; returns its folder."""
        ...

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str | None:
        """Restore a checkpoint; returns its folder."""
        ...


def checkpoint_folders(base: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The ``checkpoint_N`` folders in ``base``, oldest (smallest N) first."""
    return numbered_checkpoints(base)


def save_state(
    accelerator: _StateOwner,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    safe_serialization: bool = True,
    **engine_kwargs: Any,
) -> str:
    """Write a checkpoint of everything ``accelerator`` prepared or registered: ``accelerator.save_state(...)``.

    Collective (every process calls it) and atomic: see :meth:`lightning_accel.Accelerator.save_state`.

    Args:
        accelerator: The accelerator whose state to save.
        output_dir: Destination; must be ``None`` with automatic checkpoint naming.
        safe_serialization: Write model weights as safetensors (else ``pytorch_model.bin``); engines that write
            their own files (FSDP, DeepSpeed) ignore it, as in Accelerate.
        **engine_kwargs: Passed to DeepSpeed's ``save_checkpoint`` (e.g. ``exclude_frozen_parameters=True``).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: For a missing or conflicting destination, or ``engine_kwargs`` without DeepSpeed.

    """
    return accelerator.save_state(output_dir, safe_serialization, **engine_kwargs)


def load_state(
    accelerator: _StateOwner,
    input_dir: str | os.PathLike[str] | None = None,
    load_kwargs: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> str:
    """Restore what :func:`save_state` (or HF accelerate's) wrote: ``accelerator.load_state(...)``.

    Without ``input_dir`` and with automatic naming, the newest ``checkpoint_N`` is loaded. The save counter is set
    past the newest existing checkpoint, so the next automatic save gets a fresh folder.

    Args:
        accelerator: The accelerator whose prepared and registered objects to restore.
        input_dir: The checkpoint folder; ``None`` with automatic naming.
        load_kwargs: Keyword arguments for the ``torch.load`` of the optimizer, scheduler and loader files.
        **engine_kwargs: Passed to DeepSpeed's ``load_checkpoint`` (e.g. ``load_optimizer_states=False``).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: For a missing directory or model file, an unreadable file, a different number of registered
            objects than the checkpoint holds, or ``engine_kwargs`` without DeepSpeed.

    """
    return str(accelerator.load_state(input_dir, load_kwargs, **engine_kwargs))


def accelerate_sampler(dataloader: Any) -> Any:
    """The seedable sampler of a loader over an ``IterableDatasetShard`` (what Accelerate saves), else ``None``."""
    from lightning_accel.data_loader import IterableDatasetShard, SeedableRandomSampler, get_sampler

    if not isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
        return None
    sampler = dataloader.get_sampler() if hasattr(dataloader, "get_sampler") else get_sampler(dataloader)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def save_accelerator_state(
    output_dir: str | os.PathLike[str],
    model_states: list[dict[str, Any]],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    process_index: int,
    step: int,
    scaler: Any = None,
    save_on_each_node: bool = False,
    safe_serialization: bool = True,
) -> Path:
    """Accelerate's ``save_accelerator_state``: write states into ``output_dir`` under Accelerate's file names.

    Every process calls it. The main process (each node's with ``save_on_each_node``) writes ``model.safetensors``
    (``model_{i}.safetensors``, or ``pytorch_model.bin`` without ``safe_serialization``) from ``model_states``,
    ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin`` (a seedable sampler over an ``IterableDatasetShard``),
    ``dl_state_dict.bin`` (loaders with ``use_stateful_dataloader``) and ``scaler.pt``; each process writes
    ``random_states_{process_index}.pkl`` (``step`` and the Python, numpy, torch and CUDA generator states). The
    contents are Accelerate's; Accelerate has every process write the loader and scaler files, here one does.

    Args:
        output_dir: The folder (it must exist, as in Accelerate).
        model_states: The models' state dicts (e.g. ``accelerator.get_state_dict(model)``).
        optimizers: Optimizers (their ``state_dict()`` is saved).
        schedulers: Learning-rate schedulers.
        dataloaders: Data loaders, for their sampler or stateful-loader state.
        process_index: This process's index, in the random-states file name.
        step: The step counter saved with the random states.
        scaler: A ``torch.amp.GradScaler`` to save.
        save_on_each_node: Write the shared files on every node (node-local disks).
        safe_serialization: Weights as safetensors (one name per shared storage) instead of ``torch.save``.

    Returns:
        ``output_dir`` as a ``Path``.

    """
    target = Path(output_dir)
    if is_main_writer(save_on_each_node):
        write_shared_files(
            target, model_states, optimizers, schedulers, dataloaders, scaler, safe_serialization, accelerate_sampler
        )
    write_process_states(target, process_index, step)
    logger.info(f"Accelerator state saved in {target}", main_process_only=False)
    return target


def load_accelerator_state(
    input_dir: str | os.PathLike[str],
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    dataloaders: list[Any],
    process_index: int,
    scaler: Any = None,
    map_location: str | None = None,
    load_kwargs: dict[str, Any] | None = None,
    **load_model_func_kwargs: Any,
) -> dict[str, Any]:
    """Accelerate's ``load_accelerator_state``: restore what :func:`save_accelerator_state` (or Accelerate) wrote.

    Models get ``model.safetensors`` (else ``pytorch_model.bin``; a wrapper's ``module.`` prefix is matched),
    optimizers, schedulers, loaders, the scaler and this process's random states their files. Unlike Accelerate, a
    missing random-states file warns and an unreadable one raises (Accelerate logs and goes on either way), and every
    other unreadable or missing file raises a ``ValueError`` naming it.

    Args:
        input_dir: The checkpoint folder.
        models: The models to load into.
        optimizers: The optimizers to load into.
        schedulers: The schedulers to load into.
        dataloaders: The loaders whose sampler or stateful state to restore.
        process_index: This process's index (which random-states file to read).
        scaler: A ``torch.amp.GradScaler`` to restore.
        map_location: Where the weights and optimizer states are loaded: ``None`` or ``"cpu"`` (CPU), or
            ``"on_device"`` (this process's device).
        load_kwargs: Keyword arguments for the ``torch.load`` of the optimizer, scheduler and loader files (which are
            weights-only; ``{"weights_only": False}`` unpickles a trusted folder's in full, with a warning naming
            each file).
        **load_model_func_kwargs: Passed to each model's ``load_state_dict`` (e.g. ``strict=False``); without them
            every key must match except the tied aliases safetensors leaves out.

    Returns:
        The ``Accelerator`` attributes to set: ``{"step": ...}`` when the random states hold it.

    Raises:
        TypeError: For another ``map_location``.
        ValueError: For a missing or unreadable file, or weights that do not match a model.

    """
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError(
            "Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or `'on_device'`"
        )
    location: Any = PartialState().device if map_location == "on_device" else "cpu"
    extra = dict(load_kwargs or {})
    source = Path(input_dir)
    for i, model in enumerate(models):
        load_model_weights(model, source, i, location, **load_model_func_kwargs)
    load_state_dicts(optimizers, source, OPTIMIZER_NAME, location, **extra)
    load_state_dicts(schedulers, source, SCHEDULER_NAME, None, **extra)  # Accelerate maps the optimizers only
    load_loader_files(dataloaders, source, accelerate_sampler, **extra)
    if scaler is not None:
        load_scaler(scaler, source)
    states = load_process_states(source, process_index)
    return {"step": states["step"]} if states is not None and "step" in states else {}


def save_custom_state(
    obj: Stateful, path: str | os.PathLike[str], index: int = 0, save_on_each_node: bool = False
) -> None:
    """Write ``obj.state_dict()`` to ``{path}/custom_checkpoint_{index}.pkl`` from the main process (or each node's)."""
    location = custom_file(path, index)
    logger.info(f"Saving the state of {get_pretty_name(obj)} to {location}")
    save(obj.state_dict(), location, save_on_each_node=save_on_each_node)


def load_custom_state(obj: Stateful, path: str | os.PathLike[str], index: int = 0) -> None:
    """Load ``{path}/custom_checkpoint_{index}.pkl`` into ``obj`` (``load_state_dict``).

    Unlike Accelerate (which unpickles the file in full), weights-only: a file holding more than tensors, numbers,
    strings, containers and numpy arrays is refused naming it. Accelerate's signature has no switch: a trusted file
    loads in full with ``lightning_accel.checkpoint.state_files.load_custom_file(obj, path, index,
    weights_only=False)``.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses the file.
        ValueError: If the file is missing or unreadable (naming it).

    """
    logger.info(f"Loading the state of {get_pretty_name(obj)} from {custom_file(path, index)}")
    load_custom_file(obj, path, index)
