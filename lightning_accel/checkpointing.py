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

Accelerate's lower-level functions, with its signatures: :func:`save_accelerator_state` / :func:`load_accelerator_state`
(given state dicts, optimizers, schedulers, loaders, a scaler and the RNG states) and :func:`save_custom_state` /
:func:`load_custom_state` (one registered object). ``save_state`` and ``load_state`` write and read their files with the
same helpers.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_accel._shim.loader_checkpoint import (
    restore_loaders,
    save_loader_states,
    state_file_name,
)
from lightning_accel._shim.process_files import write_process_files
from lightning_accel._shim.sharded_checkpoint import EngineCheckpoint, engine_checkpoint
from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState
from lightning_accel.utils.constants import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_NAME,
)
from lightning_accel.utils.model_shards import match_wrapper_prefix, save_model, shard_state_dict
from lightning_accel.utils.model_shards import without_shared_storage as _without_shared_storage
from lightning_accel.utils.other import get_pretty_name, load, save
from lightning_accel.utils.random import get_rng_states, set_rng_states

if TYPE_CHECKING:
    from lightning_accel.accelerator import Accelerator
    from lightning_accel.config import ProjectConfiguration

__all__ = [
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

_CHECKPOINT_FOLDER = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_FILE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")


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


def choose_target(config: ProjectConfiguration, output_dir: str | os.PathLike[str] | None) -> Path:
    """The checkpoint folder of the next ``save_state``, by Accelerate's rules (run it on the main process).

    Raises:
        ValueError: Without ``output_dir`` and automatic naming; with both; without a project directory for
            automatic naming; or when the automatically named folder already exists.

    """
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
    if config.project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project directory: pass Accelerator(project_dir=...) or"
            " ProjectConfiguration(project_dir=...)."
        )
    target = Path(config.project_dir) / "checkpoints" / f"checkpoint_{config.iteration}"
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


def write_state(accelerator: Accelerator, folder: Path, safe_serialization: bool, **engine_kwargs: Any) -> None:
    """Write :func:`save_state`'s files into ``folder`` (chosen, then published, by the caller); collective."""
    engine = _engine(accelerator, engine_kwargs)
    if engine is not None:
        folder.mkdir(parents=True, exist_ok=True)
        engine.save(accelerator._models, accelerator._optimizers, folder, **engine_kwargs)
        accelerator.wait_for_everyone()
    if _writes_shared_files(accelerator):
        folder.mkdir(parents=True, exist_ok=True)
        _save_shared(accelerator, folder, safe_serialization, engine is None)
    accelerator.wait_for_everyone()
    write_process_files(accelerator, folder)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.iteration += 1


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
    _write_weights(weights, target, safe_serialization)
    _write_state_dicts(accelerator._optimizers if own_weights else [], target, OPTIMIZER_NAME)
    _write_state_dicts(accelerator._schedulers, target, SCHEDULER_NAME)
    scaler = getattr(accelerator.fabric.strategy.precision, "scaler", None)
    if scaler is not None:
        torch.save(scaler.state_dict(), target / SCALER_NAME)
    save_loader_states(accelerator._dataloaders, target)
    for i, obj in enumerate(accelerator._custom_objects):
        torch.save(obj.state_dict(), _custom_file(target, i))


def _write_weights(states: Sequence[Mapping[str, Any]], target: Path, safe_serialization: bool) -> None:
    """``model.safetensors`` (``model_{i}.safetensors``; one name per shared storage) or ``pytorch_model.bin``."""
    for i, state in enumerate(states):
        if safe_serialization:
            from safetensors.torch import save_file

            tensors = {key: value.detach().cpu().contiguous() for key, value in _without_shared_storage(state).items()}
            save_file(tensors, target / _indexed(SAFE_WEIGHTS_NAME, i), metadata={"format": "pt"})
        else:
            torch.save(state, target / _indexed(WEIGHTS_NAME, i))


def _write_state_dicts(objects: Sequence[Any], target: Path, stem: str) -> None:
    """``{stem}.bin``, ``{stem}_1.bin``, ...: each object's ``state_dict()`` (optimizers, schedulers)."""
    for i, obj in enumerate(objects):
        torch.save(obj.state_dict(), target / _indexed(f"{stem}.bin", i))


def _custom_file(folder: str | os.PathLike[str], index: int) -> Path:
    return Path(folder) / f"custom_checkpoint_{index}.pkl"


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


def _read(path: Path, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(path)
    except Exception as err:
        raise ValueError(
            f"Could not read checkpoint file {path}: {err}. The file may be truncated or corrupt."
        ) from err


def _torch_load(path: Path, map_location: Any = "cpu", **load_kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only`` and numpy's types allowed (:func:`lightning_accel.utils.other.load`)."""
    return load(path, map_location=map_location, **load_kwargs)


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


def load_state(
    accelerator: Accelerator,
    input_dir: str | os.PathLike[str] | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
    **engine_kwargs: Any,
) -> str:
    """Restore what :func:`save_state` (or HF accelerate's) wrote; every process calls it.

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
    extra = dict(load_kwargs or {})
    _load_state_dicts(accelerator._optimizers if engine is None else [], source, OPTIMIZER_NAME, **extra)
    _load_state_dicts(accelerator._schedulers, source, SCHEDULER_NAME, **extra)
    _load_custom_objects(accelerator._custom_objects, source)
    _load_rng_and_loaders(accelerator, source, extra)
    _restore_save_counter(accelerator, source)
    return str(source)


def _load_model(
    module: torch.nn.Module, source: Path, index: int, map_location: Any = "cpu", **load_model_func_kwargs: Any
) -> Any:
    """Load model ``index``'s weights (safetensors first, else ``pytorch_model.bin``) into ``module``.

    A wrapper's ``module.`` prefix is added or stripped to match. Without ``load_model_func_kwargs`` every key must
    match but the tied aliases safetensors leaves out; with them, ``module.load_state_dict`` applies its own rules.

    Raises:
        ValueError: For a missing or unreadable file, or (without ``load_model_func_kwargs``) keys that do not match.

    """
    safe, plain = source / _indexed(SAFE_WEIGHTS_NAME, index), source / _indexed(WEIGHTS_NAME, index)
    if safe.is_file():
        from safetensors.torch import load_file

        state = _read(safe, lambda p: load_file(p, device=str(map_location)))
    elif plain.is_file():
        state = _read(plain, lambda p: torch.load(p, map_location=map_location, weights_only=True))
    else:
        raise ValueError(f"Checkpoint {source} has no weights for model {index}: expected {safe.name} or {plain.name}.")
    own = module.state_dict()
    state = match_wrapper_prefix(state, own.keys())
    if load_model_func_kwargs:
        return module.load_state_dict(state, **load_model_func_kwargs)
    aliases = set(own) - set(_without_shared_storage(own))  # safetensors keeps one name per tied storage
    result = module.load_state_dict(state, strict=False)
    problems = sorted(set(result.missing_keys) - aliases) + sorted(result.unexpected_keys)
    if problems:
        raise ValueError(f"Checkpoint {source} does not match model {index}: missing or unexpected {problems}.")
    return result


def _load_state_dicts(
    objects: Sequence[Any], source: Path, stem: str, map_location: Any = "cpu", **load_kwargs: Any
) -> None:
    """Load ``{stem}.bin``, ``{stem}_1.bin``, ... into each object (``load_state_dict``)."""
    for i, obj in enumerate(objects):
        path = source / _indexed(f"{stem}.bin", i)
        obj.load_state_dict(_read(path, lambda p: _torch_load(p, map_location, **load_kwargs)))


def _load_custom_objects(objects: list[Any], source: Path) -> None:
    files = sorted((int(m.group(1)), p) for p in source.iterdir() if (m := _CUSTOM_FILE.match(p.name)))
    if len(files) != len(objects):
        raise ValueError(
            f"Checkpoint {source} holds {len(files)} custom_checkpoint_<i>.pkl files but {len(objects)} objects are"
            " registered; call register_for_checkpointing with the same objects, in the same order, as when saving."
        )
    for (index, _), obj in zip(files, objects, strict=True):
        load_custom_state(obj, source, index)


def _load_rng_and_loaders(accelerator: Accelerator, source: Path, load_kwargs: Mapping[str, Any]) -> None:
    path = source / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"
    states = _read(path, _torch_load) if path.is_file() else None
    restore_loaders(
        accelerator._dataloaders, source, states, lambda p: _read(p, lambda q: _torch_load(q, **load_kwargs))
    )
    if states is None:
        warnings.warn(
            f"{path} is missing: random states not restored (was the run saved by fewer processes?).", stacklevel=3
        )
        return
    accelerator.step = int(states.get("step", 0))
    set_rng_states(states)


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
    state = PartialState()
    if state.is_local_main_process if save_on_each_node else state.is_main_process:
        _write_weights(model_states, target, safe_serialization)
        _write_state_dicts(optimizers, target, OPTIMIZER_NAME)
        _write_state_dicts(schedulers, target, SCHEDULER_NAME)
        _write_loader_files(dataloaders, target)
        if scaler is not None:
            torch.save(scaler.state_dict(), target / SCALER_NAME)
    torch.save(get_rng_states(step), target / f"{RNG_STATE_NAME}_{process_index}.pkl")
    logger.info(f"Accelerator state saved in {target}", main_process_only=False)
    return target


def _iterable_seedable_sampler(dataloader: Any) -> Any:
    """The seedable sampler of a loader over an ``IterableDatasetShard`` (what Accelerate saves), else ``None``."""
    from lightning_accel.data_loader import IterableDatasetShard, SeedableRandomSampler, get_sampler

    if not isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
        return None
    sampler = dataloader.get_sampler() if hasattr(dataloader, "get_sampler") else get_sampler(dataloader)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _set_sampler(dataloader: Any, sampler: Any) -> None:
    """Put ``sampler`` back under the loader's batch sampler (Accelerate's loaders' ``set_sampler``)."""
    if hasattr(dataloader, "set_sampler"):
        dataloader.set_sampler(sampler)
    else:  # a map-style loader's batch sampler (or a BatchSampler used as the sampler) holds it
        holder = dataloader.batch_sampler if hasattr(dataloader.batch_sampler, "sampler") else dataloader.sampler
        holder.sampler = sampler


def _write_loader_files(dataloaders: Sequence[Any], target: Path) -> None:
    for i, dataloader in enumerate(dataloaders):
        sampler = _iterable_seedable_sampler(dataloader)
        if sampler is not None:
            torch.save(sampler, target / _indexed(f"{SAMPLER_NAME}.bin", i))
        if getattr(dataloader, "use_stateful_dataloader", False):
            torch.save(dataloader.state_dict(), target / state_file_name(i))


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
        load_kwargs: Keyword arguments for the ``torch.load`` of the optimizer, scheduler and loader files.
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
        _load_model(model, source, i, location, **load_model_func_kwargs)
    _load_state_dicts(optimizers, source, OPTIMIZER_NAME, location, **extra)
    _load_state_dicts(schedulers, source, SCHEDULER_NAME, None, **extra)  # Accelerate maps the optimizers only
    for i, dataloader in enumerate(dataloaders):
        if _iterable_seedable_sampler(dataloader) is not None:
            path = source / _indexed(f"{SAMPLER_NAME}.bin", i)
            _set_sampler(dataloader, _read(path, lambda p: torch.load(p, weights_only=False)))  # a pickled sampler
        state_file = source / state_file_name(i)
        if getattr(dataloader, "use_stateful_dataloader", False) and state_file.is_file():
            dataloader.load_state_dict(_read(state_file, lambda p: _torch_load(p, None, **extra)))
    if scaler is not None:
        scaler.load_state_dict(_read(source / SCALER_NAME, _torch_load))
    path = source / f"{RNG_STATE_NAME}_{process_index}.pkl"
    if not path.is_file():
        warnings.warn(f"{path} is missing: random states not restored.", stacklevel=2)
        return {}
    states = _read(path, _torch_load)
    set_rng_states(states)
    return {"step": states["step"]} if "step" in states else {}


def save_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0, save_on_each_node: bool = False) -> None:
    """Write ``obj.state_dict()`` to ``{path}/custom_checkpoint_{index}.pkl`` from the main process (or each node's)."""
    location = _custom_file(path, index)
    logger.info(f"Saving the state of {get_pretty_name(obj)} to {location}")
    save(obj.state_dict(), location, save_on_each_node=save_on_each_node)


def load_custom_state(obj: Any, path: str | os.PathLike[str], index: int = 0) -> None:
    """Load ``{path}/custom_checkpoint_{index}.pkl`` into ``obj`` (``load_state_dict``).

    As in Accelerate the file is unpickled in full (``weights_only=False``): registered objects may hold any
    picklable state, so load only checkpoints you trust.

    Raises:
        ValueError: If the file is missing or unreadable (naming it).

    """
    location = _custom_file(path, index)
    logger.info(f"Loading the state of {get_pretty_name(obj)} from {location}")
    obj.load_state_dict(_read(location, lambda p: torch.load(p, map_location="cpu", weights_only=False)))
