"""``save_state`` / ``load_state`` with Accelerate 1.15's folder and file names, so checkpoints are interchangeable.

A checkpoint folder holds ``model.safetensors`` (``model_1.safetensors``, ... or ``pytorch_model.bin`` without safe
serialization), ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt`` (fp16 with a gradient scaler),
``random_states_{rank}.pkl`` (one per process), ``custom_checkpoint_{i}.pkl`` (registered objects) and, with
``use_stateful_dataloader``, ``dl_state_dict.bin`` (``dl_state_dict_{i}.bin``; see
:mod:`lightning_accel._shim.loader_checkpoint`). Model weights are the user's module's state dict (no DDP ``module.``
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
``pytorch_model/``): see :mod:`lightning_accel._shim.sharded_checkpoint`. As in Accelerate, the save hooks then get no
weights and the load hooks no models.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_accel._shim.loader_checkpoint import loader_positions, restore_loaders, save_loader_states
from lightning_accel._shim.sharded_checkpoint import EngineCheckpoint, engine_checkpoint
from lightning_accel.utils.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

if TYPE_CHECKING:
    from lightning_accel.accelerator import Accelerator

__all__ = ["checkpoint_folders", "load_state", "save_model", "save_state", "shard_state_dict"]

_CHECKPOINT_FOLDER = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_FILE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_WRAPPER_PREFIX = "module."


def _indexed(name: str, index: int) -> str:
    """Accelerate's names for the i-th object: ``optimizer.bin``, ``optimizer_1.bin``, ..."""
    stem, ext = name.split(".", 1)
    return name if index == 0 else f"{stem}_{index}.{ext}"


def checkpoint_folders(base: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The ``checkpoint_N`` folders in ``base``, oldest (smallest N) first."""
    root = Path(base)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_FOLDER.match(p.name))]
    return sorted(found)


def _checkpoints_root(accelerator: Accelerator) -> Path:
    project_dir = accelerator.project_configuration.project_dir
    if project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project directory: pass Accelerator(project_dir=...) or"
            " ProjectConfiguration(project_dir=...)."
        )
    return Path(project_dir) / "checkpoints"


def _target_dir(accelerator: Accelerator, output_dir: str | os.PathLike[str] | None) -> Path:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
        return Path(output_dir)
    if output_dir is not None:
        raise ValueError(
            f"save_state got output_dir={os.fspath(output_dir)!r}, but automatic_checkpoint_naming is on and chooses"
            " <project_dir>/checkpoints/checkpoint_<i> itself: call save_state() without output_dir, or turn"
            " automatic naming off."
        )
    target = _checkpoints_root(accelerator) / f"checkpoint_{config.iteration}"
    if target.exists():
        raise ValueError(
            f"Checkpoint folder {target} already exists; set ProjectConfiguration(iteration=...) past it or remove it."
        )
    return target


def _writes_shared_files(accelerator: Accelerator) -> bool:
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


def save_state(
    accelerator: Accelerator,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    safe_serialization: bool = True,
    **engine_kwargs: Any,
) -> str:
    """Write a checkpoint of everything ``accelerator`` prepared or registered; collective (every process calls it).

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
    engine = _engine(accelerator, engine_kwargs)
    target = _target_dir(accelerator, output_dir)
    accelerator.wait_for_everyone()  # every process checked the target before any creates it
    if engine is not None:
        target.mkdir(parents=True, exist_ok=True)
        engine.save(accelerator._models, accelerator._optimizers, target, **engine_kwargs)
        accelerator.wait_for_everyone()
    if _writes_shared_files(accelerator):
        target.mkdir(parents=True, exist_ok=True)
        _save_shared(accelerator, target, safe_serialization, engine is None)
    accelerator.wait_for_everyone()
    target.mkdir(parents=True, exist_ok=True)
    states = {**_rng_states(accelerator.step), **loader_positions(accelerator._dataloaders)}
    torch.save(states, target / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl")
    accelerator.wait_for_everyone()
    if accelerator.project_configuration.automatic_checkpoint_naming and accelerator.is_main_process:
        _rotate(target.parent, accelerator.project_configuration.total_limit)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.iteration += 1
    return str(target)


def _engine(accelerator: Accelerator, engine_kwargs: Mapping[str, Any]) -> EngineCheckpoint | None:
    """The handler of an engine that writes its own model files, checking the arguments meant for it.

    Raises:
        ValueError: On every process, before any barrier: for ``engine_kwargs`` without such an engine, or for sharded
            (DTensor) weights that no handler writes.

    """
    engine = engine_checkpoint(accelerator.fabric.strategy)
    if engine is None:
        if engine_kwargs:
            raise ValueError(
                f"save_state/load_state got {sorted(engine_kwargs)}, keyword arguments for DeepSpeed's"
                f" save_checkpoint/load_checkpoint, but this run is {accelerator.distributed_type}; drop them."
            )
        _refuse_sharded(list(accelerator._models))
    return engine


def _save_shared(accelerator: Accelerator, target: Path, safe_serialization: bool, own_weights: bool) -> None:
    """Write the main process's files: weights and optimizers (unless an engine did), schedulers, scaler, objects."""
    models = list(accelerator._models)
    # The users' modules, without the strategy's wrapper; an engine saved its own (hooks get none, as in Accelerate).
    weights = [model.state_dict() for model in models] if own_weights else []
    user_models = [model.module for model in models]  # hooks see the users' modules, as Accelerate's do
    for hook in list(accelerator._save_state_pre_hooks.values()):
        hook(user_models, weights, str(target))  # a hook may pop entries to save them its own way
    for i, state in enumerate(weights):
        if safe_serialization:
            from safetensors.torch import save_file

            tensors = {key: value.detach().cpu().contiguous() for key, value in _without_shared_storage(state).items()}
            save_file(tensors, target / _indexed(SAFE_WEIGHTS_NAME, i), metadata={"format": "pt"})
        else:
            torch.save(state, target / _indexed(WEIGHTS_NAME, i))
    for i, optimizer in enumerate(accelerator._optimizers if own_weights else []):
        torch.save(optimizer.state_dict(), target / _indexed(f"{OPTIMIZER_NAME}.bin", i))
    for i, scheduler in enumerate(accelerator._schedulers):
        torch.save(scheduler.state_dict(), target / _indexed(f"{SCHEDULER_NAME}.bin", i))
    scaler = getattr(accelerator.fabric.strategy.precision, "scaler", None)
    if scaler is not None:
        torch.save(scaler.state_dict(), target / SCALER_NAME)
    save_loader_states(accelerator._dataloaders, target)
    for i, obj in enumerate(accelerator._custom_objects):
        torch.save(obj.state_dict(), target / f"custom_checkpoint_{i}.pkl")


def _refuse_sharded(models: list[torch.nn.Module]) -> None:
    """Raise on every process (before any barrier) when a model has sharded (DTensor) parameters.

    Raises:
        ValueError: Naming the first sharded parameter and what to use instead.

    """
    from torch.distributed.tensor import DTensor

    sharded = [name for model in models for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"save_state cannot write the sharded (DTensor) weights of this strategy ({sharded[0]!r} is one); use"
            " accelerator.save_model(model, directory), which gathers them, or train with FSDP, whose checkpoints"
            " save_state writes."
        )


def _rng_states(step: int) -> dict[str, Any]:
    """The generator states of this process, under Accelerate's keys (numpy's as ``np.random.get_state()``)."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _rotate(root: Path, total_limit: int | None) -> None:
    """Delete the oldest ``checkpoint_N`` folders so that ``total_limit`` remain (the newest was just written)."""
    if total_limit is None:
        return
    folders = checkpoint_folders(root)
    for _, folder in folders[: max(0, len(folders) - total_limit)]:
        shutil.rmtree(folder)


def _read(path: Path, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(path)
    except Exception as err:
        raise ValueError(
            f"Could not read checkpoint file {path}: {err}. The file may be truncated or corrupt."
        ) from err


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _rng_load(path: Path) -> Any:
    reconstruct = importlib.import_module("numpy._core.multiarray")._reconstruct
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType, reconstruct]  # what numpy's RNG state pickles
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def _source_dir(accelerator: Accelerator, input_dir: str | os.PathLike[str] | None) -> Path:
    if input_dir is not None:
        source = Path(input_dir)
        if not source.is_dir():
            raise ValueError(f"Checkpoint directory {source} does not exist.")
        return source
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
    folders = checkpoint_folders(_checkpoints_root(accelerator))
    if not folders:
        raise ValueError(f"No checkpoint_<i> folder in {_checkpoints_root(accelerator)} to load.")
    return folders[-1][1]


def load_state(accelerator: Accelerator, input_dir: str | os.PathLike[str] | None = None, **engine_kwargs: Any) -> str:
    """Restore what :func:`save_state` (or HF accelerate's) wrote; every process calls it.

    Without ``input_dir`` and with automatic naming, the newest ``checkpoint_N`` is loaded. The save counter is set
    past the newest existing checkpoint, so the next automatic save gets a fresh folder.

    Args:
        accelerator: The accelerator whose prepared and registered objects to restore.
        input_dir: The checkpoint folder; ``None`` with automatic naming.
        **engine_kwargs: Passed to DeepSpeed's ``load_checkpoint`` (e.g. ``load_optimizer_states=False``).

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: For a missing directory or model file, an unreadable file, a different number of registered
            objects than the checkpoint holds, or ``engine_kwargs`` without DeepSpeed.

    """
    engine = _engine(accelerator, engine_kwargs)
    source = _source_dir(accelerator, input_dir)
    models = list(accelerator._models) if engine is None else []  # an engine loads its models itself
    user_models = [model.module for model in models]
    for hook in list(accelerator._load_state_pre_hooks.values()):
        hook(user_models, str(source))  # a hook may pop models to load them its own way
    kept = {id(module) for module in user_models}
    models = [model for model in models if id(model.module) in kept]
    scaler = getattr(accelerator.fabric.strategy.precision, "scaler", None)
    if scaler is not None and (source / SCALER_NAME).is_file():
        scaler.load_state_dict(_read(source / SCALER_NAME, _torch_load))  # before optimizers, which FSDP2 may step
    if engine is not None:
        engine.load(accelerator._models, accelerator._optimizers, source, **engine_kwargs)
    for i, model in enumerate(models):
        _load_model(model, source, i)
    for i, optimizer in enumerate(accelerator._optimizers if engine is None else []):
        optimizer.load_state_dict(_read(source / _indexed(f"{OPTIMIZER_NAME}.bin", i), _torch_load))
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(_read(source / _indexed(f"{SCHEDULER_NAME}.bin", i), _torch_load))
    _load_custom_objects(accelerator._custom_objects, source)
    _load_rng_and_loaders(accelerator, source)
    _restore_save_counter(accelerator, source)
    return str(source)


def _load_model(module: torch.nn.Module, source: Path, index: int) -> None:
    safe, plain = source / _indexed(SAFE_WEIGHTS_NAME, index), source / _indexed(WEIGHTS_NAME, index)
    if safe.is_file():
        from safetensors.torch import load_file

        state = _read(safe, lambda p: load_file(p, device="cpu"))
    elif plain.is_file():
        state = _read(plain, _torch_load)
    else:
        raise ValueError(f"Checkpoint {source} has no weights for model {index}: expected {safe.name} or {plain.name}.")
    own = module.state_dict()
    state = _match_wrapper_prefix(state, own.keys())
    aliases = set(own) - set(_without_shared_storage(own))  # safetensors keeps one name per tied storage
    result = module.load_state_dict(state, strict=False)
    problems = sorted(set(result.missing_keys) - aliases) + sorted(result.unexpected_keys)
    if problems:
        raise ValueError(f"Checkpoint {source} does not match model {index}: missing or unexpected {problems}.")


def _match_wrapper_prefix(state: Mapping[str, Any], expected: Any) -> dict[str, Any]:
    """Add or strip a wrapper's ``module.`` prefix (weights saved from a wrapped model by other tools)."""
    keys = set(expected)
    if set(state) == keys:
        return dict(state)
    if all(k.startswith(_WRAPPER_PREFIX) for k in keys):
        return {f"{_WRAPPER_PREFIX}{k}": v for k, v in state.items()}
    if all(k.startswith(_WRAPPER_PREFIX) for k in state):
        return {k[len(_WRAPPER_PREFIX) :]: v for k, v in state.items()}
    return dict(state)


def _load_custom_objects(objects: list[Any], source: Path) -> None:
    files = sorted((int(m.group(1)), p) for p in source.iterdir() if (m := _CUSTOM_FILE.match(p.name)))
    if len(files) != len(objects):
        raise ValueError(
            f"Checkpoint {source} holds {len(files)} custom_checkpoint_<i>.pkl files but {len(objects)} objects are"
            " registered; call register_for_checkpointing with the same objects, in the same order, as when saving."
        )
    for (_, path), obj in zip(files, objects, strict=True):
        # Registered objects may hold any picklable state, as in Accelerate: load only checkpoints you trust.
        obj.load_state_dict(_read(path, lambda p: torch.load(p, map_location="cpu", weights_only=False)))


def _load_rng_and_loaders(accelerator: Accelerator, source: Path) -> None:
    path = source / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"
    states = _read(path, _rng_load) if path.is_file() else None
    restore_loaders(accelerator._dataloaders, source, states, lambda p: _read(p, _torch_load))
    if states is None:
        warnings.warn(
            f"{path} is missing: random states not restored (was the run saved by fewer processes?).", stacklevel=3
        )
        return
    accelerator.step = int(states.get("step", 0))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _restore_save_counter(accelerator: Accelerator, source: Path) -> None:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        return
    numbers = [n for n, _ in checkpoint_folders(_checkpoints_root(accelerator))]
    loaded = _CHECKPOINT_FOLDER.match(source.name)
    if loaded:
        numbers.append(int(loaded.group(1)))
    if numbers:
        config.iteration = max(config.iteration, max(numbers) + 1)


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


def _without_shared_storage(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (safetensors refuses shared tensors)."""
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

    Stale shard files of an earlier save in ``save_directory`` are removed.

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
        state = _without_shared_storage(state)
    pattern = f"{SAFE_MODEL_NAME}{{suffix}}.safetensors" if safe_serialization else f"{MODEL_NAME}{{suffix}}.bin"
    shards = shard_state_dict(state, pattern, max_shard_size)
    stem = pattern.split("{")[0]
    for old in directory.iterdir():
        stale = old.is_file() and old.name.startswith(stem) and old.name not in shards
        if stale and _SHARD_FILE.fullmatch(old.name.rsplit(".", 1)[0]):
            old.unlink()
    for filename, names in shards.items():
        shard = {name: state[name] for name in names}
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(
                {k: v.detach().cpu().contiguous() for k, v in shard.items()}, directory / filename, {"format": "pt"}
            )
        else:
            torch.save(shard, directory / filename)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, names in shards.items() for n in names}}
        index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
        (directory / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
