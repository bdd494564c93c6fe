"""Accelerate 1.15's ``save_state`` files, written and read by functions that take explicit arguments.

The one implementation of each file, used by ``Accelerator.save_state``/``load_state`` (which gather the arguments)
and by Accelerate's ``save_accelerator_state``/``load_accelerator_state`` at :mod:`lightning_accel.checkpointing`.
Nothing here sees an ``Accelerator``, as in Accelerate's own ``checkpointing.py``.

A folder holds ``model.safetensors`` (``model_1.safetensors``, ... or ``pytorch_model.bin``), ``optimizer.bin``,
``scheduler.bin``, ``sampler.bin`` (a seedable sampler over an ``IterableDatasetShard``), ``dl_state_dict.bin``
(stateful loaders), ``scaler.pt``, ``random_states_{rank}.pkl`` (one per process) and ``custom_checkpoint_{i}.pkl``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_accel.checkpoint.folders import numbered_checkpoints
from lightning_accel.checkpoint.loader_states import ResumableLoader, restore_loaders, state_file_name
from lightning_accel.checkpoint.weight_shards import match_wrapper_prefix, without_shared_storage
from lightning_accel.config import ProjectConfiguration
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
from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file
from lightning_accel.utils.other import load, safetensors_save, torch_save
from lightning_accel.utils.random import get_rng_states, set_rng_states

__all__ = [
    "SamplerOf",
    "Stateful",
    "checkpoints_root",
    "choose_target",
    "custom_file",
    "indexed",
    "is_main_writer",
    "latest_source",
    "load_custom_file",
    "load_custom_objects",
    "load_loader_files",
    "load_model_weights",
    "load_process_states",
    "load_samplers",
    "load_scaler",
    "load_state_dicts",
    "next_iteration",
    "process_record",
    "read_file",
    "write_process_record",
    "write_process_states",
    "write_shared_files",
]

_CHECKPOINT_FOLDER = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_FILE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")


class Stateful(Protocol):
    """An object saved through its ``state_dict`` (optimizers, schedulers, scalers, registered objects)."""

    def state_dict(self) -> Any:
        """The state to save."""
        ...

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Restore a saved state."""
        ...


SamplerOf = Callable[[Any], Any]
"""Gives the sampler of a loader that Accelerate pickles into ``sampler.bin``, or ``None`` (the shim's rule)."""


def _no_sampler(dataloader: Any) -> Any:
    return None


def indexed(name: str, index: int) -> str:
    """Accelerate's names for the i-th object: ``optimizer.bin``, ``optimizer_1.bin``, ..."""
    stem, ext = name.split(".", 1)
    return name if index == 0 else f"{stem}_{index}.{ext}"


def custom_file(folder: str | os.PathLike[str], index: int) -> Path:
    """``{folder}/custom_checkpoint_{index}.pkl``."""
    return Path(folder) / f"custom_checkpoint_{index}.pkl"


def _process_file(folder: Path, process_index: int) -> Path:
    return folder / f"{RNG_STATE_NAME}_{process_index}.pkl"


# --- where: automatic naming -------------------------------------------------------------------------------------


def checkpoints_root(config: ProjectConfiguration) -> Path:
    """``<project_dir>/checkpoints``, where automatically named checkpoints go.

    Raises:
        ValueError: Without a project directory.

    """
    if config.project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project directory: pass Accelerator(project_dir=...) or"
            " ProjectConfiguration(project_dir=...)."
        )
    return Path(config.project_dir) / "checkpoints"


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
    target = checkpoints_root(config) / f"checkpoint_{config.iteration}"
    if target.exists():
        raise ValueError(
            f"Checkpoint folder {target} already exists; set ProjectConfiguration(iteration=...) past it or remove it."
        )
    return target


def latest_source(config: ProjectConfiguration, input_dir: str | os.PathLike[str] | None) -> Path:
    """The folder ``load_state`` reads: ``input_dir``, or the newest ``checkpoint_<i>`` with automatic naming.

    Raises:
        ValueError: For a missing ``input_dir``, or no input and no checkpoint to find.

    """
    if input_dir is not None:
        source = Path(input_dir)
        if not source.is_dir():
            raise ValueError(f"Checkpoint directory {source} does not exist.")
        return source
    if not config.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
    folders = numbered_checkpoints(checkpoints_root(config))
    if not folders:
        raise ValueError(f"No checkpoint_<i> folder in {checkpoints_root(config)} to load.")
    return folders[-1][1]


def next_iteration(config: ProjectConfiguration, source: Path) -> int:
    """The save counter after loading ``source``: past the newest checkpoint, so the next save gets a fresh folder."""
    if not config.automatic_checkpoint_naming:
        return config.iteration
    numbers = [n for n, _ in numbered_checkpoints(checkpoints_root(config))]
    loaded = _CHECKPOINT_FOLDER.match(source.name)
    if loaded:
        numbers.append(int(loaded.group(1)))
    return max(config.iteration, max(numbers) + 1) if numbers else config.iteration


# --- writing -------------------------------------------------------------------------------------------------------


def write_shared_files(
    target: Path,
    model_states: Sequence[Mapping[str, Any]],
    optimizers: Sequence[Stateful],
    schedulers: Sequence[Stateful],
    dataloaders: Sequence[Any],
    scaler: Stateful | None = None,
    safe_serialization: bool = True,
    sampler_of: SamplerOf = _no_sampler,
) -> None:
    """Write the files one process writes: weights, optimizers, schedulers, loader files and the scaler.

    Args:
        target: The folder (it must exist).
        model_states: The models' state dicts: ``model.safetensors``, ``model_1.safetensors``, ... (one name per
            shared storage), or ``pytorch_model.bin``, ... without ``safe_serialization``.
        optimizers: Saved as ``optimizer.bin``, ``optimizer_1.bin``, ...
        schedulers: Saved as ``scheduler.bin``, ...
        dataloaders: Their sampler (``sampler.bin``, where ``sampler_of`` gives one) and, with
            ``use_stateful_dataloader``, their state (``dl_state_dict.bin``).
        scaler: A gradient scaler, saved as ``scaler.pt``.
        safe_serialization: Weights as safetensors.
        sampler_of: Which loaders' samplers to pickle (Accelerate's: a seedable sampler over an
            ``IterableDatasetShard``).

    """
    _write_weights(model_states, target, safe_serialization)
    _write_state_dicts(optimizers, target, OPTIMIZER_NAME)
    _write_state_dicts(schedulers, target, SCHEDULER_NAME)
    _write_loader_files(dataloaders, target, sampler_of)
    if scaler is not None:
        torch_save(scaler.state_dict(), target / SCALER_NAME)


def process_record(step: int, loader_record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What this process's ``random_states_{i}.pkl`` holds now: ``step``, its generators, and ``loader_record``.

    ``loader_record`` (:func:`~lightning_accel.checkpoint.loader_states.loader_positions`) adds keys Accelerate ignores.
    """
    return {**get_rng_states(step), **(loader_record or {})}


def write_process_record(folder: Path, process_index: int, record: Mapping[str, Any]) -> None:
    """Write a :func:`process_record` as ``random_states_{process_index}.pkl``."""
    torch_save(dict(record), _process_file(folder, process_index))


def write_process_states(
    folder: Path, process_index: int, step: int, loader_record: Mapping[str, Any] | None = None
) -> None:
    """Write this process's ``random_states_{process_index}.pkl`` as they are now (see :func:`process_record`)."""
    write_process_record(folder, process_index, process_record(step, loader_record))


def _write_weights(states: Sequence[Mapping[str, Any]], target: Path, safe_serialization: bool) -> None:
    for i, state in enumerate(states):
        if safe_serialization:
            tensors = {key: value.detach().cpu().contiguous() for key, value in without_shared_storage(state).items()}
            safetensors_save(tensors, target / indexed(SAFE_WEIGHTS_NAME, i))
        else:
            torch_save(state, target / indexed(WEIGHTS_NAME, i))


def _write_state_dicts(objects: Sequence[Stateful], target: Path, stem: str) -> None:
    for i, obj in enumerate(objects):
        torch_save(obj.state_dict(), target / indexed(f"{stem}.bin", i))


def _write_loader_files(dataloaders: Sequence[Any], target: Path, sampler_of: SamplerOf) -> None:
    for i, dataloader in enumerate(dataloaders):
        sampler = sampler_of(dataloader)
        if sampler is not None:
            torch_save(sampler, target / indexed(f"{SAMPLER_NAME}.bin", i))
        if getattr(dataloader, "use_stateful_dataloader", False):
            torch_save(dataloader.state_dict(), target / state_file_name(i))


# --- reading -------------------------------------------------------------------------------------------------------


def read_file(path: Path, reader: Callable[[Path], Any]) -> Any:
    """``reader(path)``, any failure (a missing file too) raised as ``ValueError`` naming the file.

    A weights-only refusal says so, naming the file and the opt-in (:func:`read_checkpoint_file`).

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refused the file.
        ValueError: Naming ``path`` and the reader's error.

    """
    try:
        return read_checkpoint_file(path, reader)
    except FileNotFoundError as err:
        raise ValueError(
            f"Could not read checkpoint file {path}: {err}. The file may be truncated or corrupt."
        ) from err


def _torch_load(path: Path, map_location: Any = "cpu", **load_kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only`` and numpy's types allowed (:func:`lightning_accel.utils.other.load`)."""
    return load(path, map_location=map_location, **load_kwargs)


def load_scaler(scaler: Stateful, source: Path) -> None:
    """Restore ``scaler`` from ``scaler.pt``.

    Raises:
        ValueError: If the file is missing or unreadable.

    """
    scaler.load_state_dict(read_file(source / SCALER_NAME, _torch_load))


def load_model_weights(
    module: torch.nn.Module, source: Path, index: int, map_location: Any = "cpu", **load_model_func_kwargs: Any
) -> Any:
    """Load model ``index``'s weights (safetensors first, else ``pytorch_model.bin``) into ``module``.

    A wrapper's ``module.`` prefix is added or stripped to match. Without ``load_model_func_kwargs`` every key must
    match but the tied aliases safetensors leaves out; with them, ``module.load_state_dict`` applies its own rules.

    Raises:
        ValueError: For a missing or unreadable file, or (without ``load_model_func_kwargs``) keys that do not match.

    """
    safe, plain = source / indexed(SAFE_WEIGHTS_NAME, index), source / indexed(WEIGHTS_NAME, index)
    if safe.is_file():
        from safetensors.torch import load_file

        state = read_file(safe, lambda p: load_file(p, device=str(map_location)))
    elif plain.is_file():
        state = read_file(plain, lambda p: load(p, map_location=map_location))
    else:
        raise ValueError(f"Checkpoint {source} has no weights for model {index}: expected {safe.name} or {plain.name}.")
    own = module.state_dict()
    state = match_wrapper_prefix(state, own.keys())
    if load_model_func_kwargs:
        return module.load_state_dict(state, **load_model_func_kwargs)
    aliases = set(own) - set(without_shared_storage(own))  # safetensors keeps one name per tied storage
    result = module.load_state_dict(state, strict=False)
    problems = sorted(set(result.missing_keys) - aliases) + sorted(result.unexpected_keys)
    if problems:
        raise ValueError(f"Checkpoint {source} does not match model {index}: missing or unexpected {problems}.")
    return result


def load_state_dicts(
    objects: Sequence[Stateful], source: Path, stem: str, map_location: Any = "cpu", **load_kwargs: Any
) -> None:
    """Load ``{stem}.bin``, ``{stem}_1.bin``, ... into each object (``load_state_dict``).

    Raises:
        ValueError: For a missing or unreadable file, naming it.

    """
    for i, obj in enumerate(objects):
        path = source / indexed(f"{stem}.bin", i)
        obj.load_state_dict(read_file(path, lambda p: _torch_load(p, map_location, **load_kwargs)))


def load_custom_objects(objects: Sequence[Stateful], source: Path, *, weights_only: bool = True) -> None:
    """Load every ``custom_checkpoint_<i>.pkl`` of ``source`` into the registered ``objects``, in order.

    Weights-only by default (unlike Accelerate): a file holding other objects than tensors, numbers, strings and
    containers is refused naming it; ``weights_only=False`` unpickles a trusted folder in full, with a warning.

    Raises:
        ValueError: If the folder holds another number of files than there are objects, or a file is unreadable.

    """
    files = sorted((int(m.group(1)), p) for p in source.iterdir() if (m := _CUSTOM_FILE.match(p.name)))
    if len(files) != len(objects):
        raise ValueError(
            f"Checkpoint {source} holds {len(files)} custom_checkpoint_<i>.pkl files but {len(objects)} objects are"
            " registered; call register_for_checkpointing with the same objects, in the same order, as when saving."
        )
    for (index, _), obj in zip(files, objects, strict=True):
        load_custom_file(obj, source, index, weights_only=weights_only)


def load_custom_file(obj: Stateful, folder: str | os.PathLike[str], index: int, *, weights_only: bool = True) -> None:
    """Load ``{folder}/custom_checkpoint_{index}.pkl`` into ``obj`` (weights-only unless ``weights_only=False``).

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses the file, naming it.
        ValueError: If the file is missing or unreadable (naming it).

    """
    location = custom_file(folder, index)
    obj.load_state_dict(read_file(location, lambda p: load(p, map_location="cpu", weights_only=weights_only)))


def load_samplers(
    dataloaders: Sequence[Any], source: Path, sampler_of: SamplerOf, *, weights_only: bool = True
) -> None:
    """Put each loader's pickled sampler (``sampler.bin``, ...) back, for the loaders ``sampler_of`` names.

    Weights-only by default, with the sampler and dataset classes the file names allowed (:func:`sampler_globals`);
    ``weights_only=False`` unpickles a trusted folder's other samplers, with a warning.

    Raises:
        ValueError: For a sampler file that is missing or unreadable.

    """
    for i, dataloader in enumerate(dataloaders):
        if sampler_of(dataloader) is not None:
            path = source / indexed(f"{SAMPLER_NAME}.bin", i)
            sampler = read_file(path, lambda p: load(p, extra_globals=sampler_globals(p), weights_only=weights_only))
            _set_sampler(dataloader, sampler)


def load_loader_files(
    dataloaders: Sequence[Any],
    source: Path,
    sampler_of: SamplerOf = _no_sampler,
    *,
    weights_only: bool = True,
    **load_kwargs: Any,
) -> None:
    """Restore each loader's pickled sampler (``sampler.bin``) and stateful-loader state (``dl_state_dict.bin``).

    (``Accelerator.load_state`` resumes stateful loaders with :func:`load_process_states` instead, which also
    checks that the state belongs to this number of processes.) Both are weights-only unless ``weights_only=False``
    (Accelerate's ``load_kwargs={"weights_only": False}``), which unpickles them in full with a warning.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
        ValueError: For a sampler file that is missing or unreadable, or an unreadable state file.

    """
    load_samplers(dataloaders, source, sampler_of, weights_only=weights_only)
    for i, dataloader in enumerate(dataloaders):
        state_file = source / state_file_name(i)
        if getattr(dataloader, "use_stateful_dataloader", False) and state_file.is_file():
            read = lambda p: _torch_load(p, None, weights_only=weights_only, **load_kwargs)  # noqa: E731
            dataloader.load_state_dict(read_file(state_file, read))


def sampler_globals(path: Path) -> list[type]:
    """The globals of ``path`` a weights-only load of a sampler file may rebuild.

    What a pickled sampler holds (Accelerate pickles the sampler with its dataset): classes named in the file that
    are ``torch.utils.data`` ``Sampler`` or ``Dataset`` subclasses of an already imported module (nothing is
    imported, so no function and no other class can be called), ``torch.Generator`` (a seeded sampler's) and ``range``
    (an index range as data source).
    """
    allowed: list[type] = [torch.Generator, range]
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
        module_name, _, attribute = name.rpartition(".")
        candidate = getattr(sys.modules.get(module_name), attribute, None)
        if isinstance(candidate, type) and issubclass(candidate, (torch.utils.data.Sampler, torch.utils.data.Dataset)):
            allowed.append(candidate)
    return allowed


def _set_sampler(dataloader: Any, sampler: Any) -> None:
    """Put ``sampler`` back under the loader's batch sampler (Accelerate's loaders' ``set_sampler``)."""
    if hasattr(dataloader, "set_sampler"):
        dataloader.set_sampler(sampler)
    else:  # a map-style loader's batch sampler (or a BatchSampler used as the sampler) holds it
        holder = dataloader.batch_sampler if hasattr(dataloader.batch_sampler, "sampler") else dataloader.sampler
        holder.sampler = sampler


def load_process_states(
    source: Path,
    process_index: int,
    loaders: Sequence[ResumableLoader] | None = None,
    missing_hint: str = "",
    *,
    positions: bool = True,
    **load_kwargs: Any,
) -> dict[str, Any] | None:
    """Restore this process's random states from ``random_states_{process_index}.pkl``; return what it holds.

    Args:
        source: The checkpoint folder.
        process_index: Which process's file to read.
        loaders: The prepared loaders to resume (epoch, position and ``dl_state_dict`` files, see
            :func:`~lightning_accel.checkpoint.loader_states.restore_loaders`); ``None`` leaves loaders alone.
        missing_hint: Added to the warning for a missing file.
        positions: Resume the loaders mid-epoch too (see
            :func:`~lightning_accel.checkpoint.loader_states.restore_loaders`).
        **load_kwargs: For the ``torch.load`` of the loader state files.

    Returns:
        The file's content (its ``step`` too), or ``None`` when it is missing.

    Raises:
        ValueError: For an unreadable file.

    """
    path = _process_file(source, process_index)
    states = read_file(path, _torch_load) if path.is_file() else None
    if loaders is not None:
        read = lambda p: read_file(p, lambda q: _torch_load(q, **load_kwargs))  # noqa: E731
        restore_loaders(loaders, source, states, read, positions=positions)
    if states is None:
        warnings.warn(f"{path} is missing: random states not restored{missing_hint}.", stacklevel=3)
        return None
    set_rng_states(states)
    return dict(states)


def is_main_writer(save_on_each_node: bool) -> bool:
    """Whether this process writes the shared files: the main process (each node's with ``save_on_each_node``)."""
    state = PartialState()
    return state.is_local_main_process if save_on_each_node else state.is_main_process
