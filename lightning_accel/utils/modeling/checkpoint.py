"""Accelerate's checkpoint loading for big models: whole or sharded checkpoints, weights sent where a device map says.

A checkpoint is a ``.bin`` (``torch.save``) or ``.safetensors`` file, the ``.index.json`` of a sharded one, or a
folder holding one of those. With a device map, each tensor goes to its module's device as its shard is read;
``"disk"`` tensors are written to the offload folder instead (memory-mapped ``.dat`` files), so a model larger than
RAM can be loaded one shard at a time.

One difference from Accelerate 1.15: a non-offloaded buffer of a ``"disk"`` module gets the checkpoint's value (on
the CPU); Accelerate left it as the model was built, so e.g. a BatchNorm's running statistics were lost.

Every read of a checkpoint (the shim's ``load_state``, the strategies' ``load_checkpoint``, the loaders here) goes
through :func:`read_checkpoint_file`, so a truncated or corrupt file, or one that is not a checkpoint, is reported as
``ValueError`` naming its path instead of torch's ``PytorchStreamReader failed reading zip archive``.

The offline readers of this package's strategy checkpoints live here too, as they are public at
``lightning_accel.utils``: :func:`load_full_state_dict` reads a model's full state dict from any ``acc_*`` checkpoint
(a Trainer or Fabric file, an ``acc_fsdp`` sharded folder, a DeepSpeed folder) in one process, and
:func:`consolidate_deepspeed_checkpoint` turns a DeepSpeed folder into one state dict.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from safetensors import safe_open
from safetensors.torch import load_file as safe_load_file
from torch import nn

from lightning_accel.utils.constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from lightning_accel.utils.modeling.sizes import DtypeLike, _as_dtype
from lightning_accel.utils.modeling.tensors import (
    DeviceLike,
    _owner_and_name,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    resolve_device,
    retie_parameters,
    set_module_tensor_to_device,
)
from lightning_accel.utils.offload import load_offloaded_weight, offload_weight, save_offload_index
from lightning_accel.utils.other import (
    UnsafeCheckpointError,
    is_weights_only_refusal,
    load,
    load_pickle,
    unsafe_checkpoint_error,
    warn_full_unpickling,
)

__all__ = [
    "METADATA_FILENAME",
    "CheckpointPathError",
    "check_deepspeed_files",
    "consolidate_deepspeed_checkpoint",
    "contained_path",
    "contained_reader",
    "deepspeed_globals",
    "deepspeed_tag_folder",
    "is_sharded_checkpoint",
    "load_checkpoint_in_model",
    "load_full_state_dict",
    "load_offloaded_weights",
    "load_state_dict",
    "read_checkpoint_file",
    "read_sharded_entries",
    "strip_prefix",
    "weights_only_planner",
]

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

logger = logging.getLogger(__name__)

T = TypeVar("T")
V = TypeVar("V")
P = TypeVar("P", bound="str | os.PathLike[str]")


def read_checkpoint_file(path: P, reader: Callable[[P], T]) -> T:
    """``reader(path)``, with any failure but a missing file re-raised naming ``path``.

    A weights-only refusal (the reader's own load, or torch's inside an engine's reader) is reported as one, naming
    ``path`` and the opt-in, not as a truncated file.

    Raises:
        FileNotFoundError: If ``path`` does not exist (as the reader raised it).
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refused the file.
        CheckpointPathError: (a ``ValueError``) If the checkpoint names a file outside its folder.
        ValueError: If the reader failed on the file's content, naming the file and the reader's reason.

    """
    try:
        return reader(path)
    except (FileNotFoundError, UnsafeCheckpointError, CheckpointPathError):
        raise
    except Exception as err:
        if is_weights_only_refusal(err):
            raise unsafe_checkpoint_error(path, cast(pickle.UnpicklingError, err)) from err
        raise ValueError(
            f"Could not read checkpoint file {path}: {str(err).rstrip('.')}. The file may be truncated or corrupt "
            "(a save that was interrupted, a partial copy) or not a checkpoint; point to an intact checkpoint."
        ) from err
    except BaseException as err:  # DCP's CheckpointException wraps each process's error
        refusal = _refusal_inside(err)
        if refusal is None:
            raise
        raise refusal from err


class CheckpointPathError(ValueError):
    """A checkpoint names a file outside its own folder."""


def contained_path(folder: str | os.PathLike[str], entry: str, named_in: str | os.PathLike[str]) -> Path:
    """``folder / entry`` resolved, refused unless it stays inside ``folder``.

    Every path a checkpoint names (a safetensors index's ``weight_map`` entry, a DeepSpeed ``latest`` tag, an FSDP
    layout's file) goes through here, so a hostile checkpoint cannot make a load read outside its folder.

    Args:
        folder: The checkpoint folder.
        entry: The path as the checkpoint names it (relative to ``folder``).
        named_in: The file that names ``entry`` (for the error).

    Raises:
        CheckpointPathError: (a ``ValueError``) If ``entry`` is absolute or resolves (through ``..`` or a link)
            outside ``folder``, naming the entry, the folder and the file that named it.

    """
    root = Path(folder).resolve()
    resolved = (root / entry).resolve()
    if Path(entry).is_absolute() or not resolved.is_relative_to(root) or resolved == root:
        raise CheckpointPathError(
            f"{os.fspath(named_in)} names {entry!r}, which is outside the checkpoint folder {os.fspath(root)}"
            f" (it resolves to {os.fspath(resolved)}); refusing to read it. A checkpoint may only name files inside"
            " its own folder: repair or replace the checkpoint."
        )
    return resolved


def weights_only_planner(
    planner: LoadPlanner, folder: str | os.PathLike[str], weights_only: bool = True
) -> LoadPlanner:
    """``planner`` (a DCP load planner for ``folder``) with its non-tensor entries loaded weights-only.

    DCP unpickles each non-tensor entry of a sharded folder in full (``weights_only=False``); the returned planner
    first loads the entry weights-only through :func:`~lightning_accel.utils.other.load`, so an entry holding
    anything else is refused naming the folder, the entry and the opt-in, and nothing in it runs.
    ``weights_only=False`` leaves DCP's full unpickling, with a warning naming the folder.

    Args:
        planner: The planner the read would use (``DefaultLoadPlanner``, ...); changed in place and returned.
        folder: The sharded checkpoint folder (for the refusal and the warning).
        weights_only: ``False`` for a folder you trust.

    """
    if not weights_only:
        warn_full_unpickling(folder)
        return planner
    unpickle = planner.load_bytes

    def load_bytes(read_item: ReadItem, value: io.BytesIO) -> None:
        load(value, map_location="cpu", name=f"{os.fspath(folder)} (its entry {read_item.dest_index.fqn!r})")
        value.seek(0)  # what a weights-only load accepts is safe to hand to DCP's full unpickling
        unpickle(read_item, value)

    planner.load_bytes = load_bytes  # type: ignore[method-assign]
    return planner


# What DCP's ``.metadata`` pickles besides its own dataclasses and torch's dtypes.
_DCP_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", kind) for kind in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


def _dcp_metadata_global(module: str, name: str) -> bool:
    """Whether a DCP ``.metadata`` file may rebuild ``module.name``: its own dataclasses, sizes, dtypes, paths."""
    if module == "torch.distributed.checkpoint.metadata":
        return isinstance(getattr(sys.modules.get(module), name, None), type)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    return (module, name) in _DCP_METADATA_GLOBALS


def contained_reader(folder: str | os.PathLike[str]) -> FileSystemReader:
    """DCP's ``FileSystemReader`` for ``folder``, once its ``.metadata`` is checked.

    DCP unpickles ``.metadata`` in full; it is first unpickled here with only DCP's metadata types allowed
    (:func:`~lightning_accel.utils.other.load_pickle`), and every shard file it names must stay inside ``folder``.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If ``.metadata`` holds other objects, naming it.
        CheckpointPathError: (a ``ValueError``) For a shard path outside ``folder``, naming it
            (:func:`contained_path`).

    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata_file = Path(folder) / ".metadata"
    if metadata_file.is_file():
        metadata: Metadata = read_checkpoint_file(metadata_file, lambda p: load_pickle(p, _dcp_metadata_global))
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            contained_path(folder, os.fspath(info.relative_path), metadata_file)
    return FileSystemReader(folder)


def read_sharded_entries(
    folder: str | os.PathLike[str], keys: set[str] | None = None, weights_only: bool = True
) -> dict[str, Any]:
    """The entries ``keys`` (all by default) of a sharded (DCP) folder, read in this process alone.

    Non-tensor entries load weights-only unless ``weights_only=False`` (:func:`weights_only_planner`), and shard
    paths must stay inside the folder (:func:`contained_reader`).

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If an entry holds more than a weights-only load accepts.
        ValueError: If the folder's metadata names a file outside it.

    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    planner = weights_only_planner(_EmptyStateDictLoadPlanner(keys=keys), folder, weights_only)
    read = lambda f: _load_state_dict(state, storage_reader=contained_reader(f), planner=planner, no_dist=True)  # noqa: E731
    read_checkpoint_file(folder, read)
    return state


def _refusal_inside(err: BaseException) -> UnsafeCheckpointError | CheckpointPathError | None:
    """Our refusal among the per-process failures of a DCP ``CheckpointException``, if any."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException):
        return None
    for failure in err.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, (UnsafeCheckpointError, CheckpointPathError)):
            return cause
    return None


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


def _main_device(device_map: Mapping[str, DeviceLike]) -> DeviceLike:
    """Where offloaded 8-bit weights are quantized: the lowest accelerator index of the map, else the CPU."""
    indices = sorted(device for device in device_map.values() if isinstance(device, int))
    return indices[0] if indices else "cpu"


def _device_name(device: DeviceLike) -> str:
    return str(resolve_device(device))


def _check_safetensors_format(checkpoint_file: str, metadata: Mapping[str, str] | None) -> None:
    if metadata is None:
        logger.warning(
            f"The safetensors archive passed at {checkpoint_file} does not contain metadata. Make sure to save your "
            "model with the `save_pretrained` method. Defaulting to 'pt' metadata."
        )
        return
    if metadata.get("format") not in ("pt", "tf", "flax"):
        raise OSError(
            f"The safetensors archive passed at {checkpoint_file} does not contain the valid metadata. Make sure you "
            "save your model with the `save_pretrained` method."
        )
    if metadata["format"] != "pt":
        raise ValueError(f"The checkpoint passed was saved with {metadata['format']}, we need a the pt format.")


def _owning_entry(name: str, device_map: Mapping[str, Any]) -> str | None:
    """The device-map key covering tensor ``name`` (the longest prefix), or ``None``."""
    while name not in device_map:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return name


def _safetensors_header(file: str) -> tuple[dict[str, str] | None, list[str]]:
    with safe_open(file, framework="pt") as f:
        return f.metadata(), list(f.keys())


def load_state_dict(
    checkpoint_file: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, torch.Tensor]:
    """Read a checkpoint file; a safetensors one is read straight onto the devices ``device_map`` gives.

    Args:
        checkpoint_file: A ``.safetensors`` file or a ``torch.save`` file (read weights-only).
        device_map: Module names to devices; ``"disk"`` tensors, and tensors without an entry, are read to the CPU.
        weights_only: ``False`` unpickles a trusted ``torch.save`` file in full, with a warning naming it.

    Raises:
        OSError: For a safetensors file whose metadata names no known format.
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a ``torch.save`` file.
        ValueError: For a safetensors file saved by another framework, or a file that cannot be read (truncated,
            corrupt, not a checkpoint), naming the file.

    """
    checkpoint_file = os.fspath(checkpoint_file)
    if not checkpoint_file.endswith(".safetensors"):
        return dict(
            read_checkpoint_file(checkpoint_file, lambda f: load(f, map_location="cpu", weights_only=weights_only))
        )
    metadata, names = read_checkpoint_file(checkpoint_file, _safetensors_header)
    _check_safetensors_format(checkpoint_file, metadata)
    if device_map is None:
        return read_checkpoint_file(checkpoint_file, safe_load_file)
    devices = set(device_map.values())
    if len(devices) == 1 and "disk" not in devices:
        device = _device_name(next(iter(devices)))
        return read_checkpoint_file(checkpoint_file, lambda file: safe_load_file(file, device=device))

    by_device: dict[str, list[str]] = {}
    for name in names:
        entry = _owning_entry(name, device_map)
        device = "cpu" if entry is None or device_map[entry] == "disk" else _device_name(device_map[entry])
        by_device.setdefault(device, []).append(name)
    return read_checkpoint_file(checkpoint_file, lambda file: _read_on_devices(file, by_device))


def _read_on_devices(file: str, by_device: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for device, device_names in by_device.items():
        with safe_open(file, framework="pt", device=device) as f:
            for name in device_names:
                tensors[name] = f.get_tensor(name)
    return tensors


def load_offloaded_weights(
    model: nn.Module, index: Mapping[str, Any] | None, offload_folder: str | os.PathLike[str]
) -> None:
    """Load the ``.dat`` weights listed in ``index`` from ``offload_folder`` into ``model``, on the CPU.

    Args:
        model: The model.
        index: Tensor names to their ``dtype``/``shape`` (an offload folder's ``index.json``).
        offload_folder: The folder holding the ``.dat`` files.

    """
    for name, info in (index or {}).items():
        if "SCB" in name:
            continue
        statistics_name = name.replace("weight", "SCB")
        statistics = None
        if "weight" in name and statistics_name in index:  # type: ignore[operator]
            statistics_file = os.path.join(offload_folder, f"{statistics_name}.dat")
            statistics = load_offloaded_weight(statistics_file, index[statistics_name])  # type: ignore[index]
        weight = load_offloaded_weight(os.path.join(offload_folder, f"{name}.dat"), info)
        set_module_tensor_to_device(model, name, "cpu", value=weight, fp16_statistics=statistics)


def _checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[str]:
    """The files a checkpoint path stands for: itself, its index's shards, or the folder's weights or shards."""
    checkpoint = os.fspath(checkpoint)
    index_file = None
    if os.path.isfile(checkpoint):
        if not checkpoint.endswith(".json"):
            return [checkpoint]
        index_file = checkpoint
    elif os.path.isdir(checkpoint):
        for whole in (WEIGHTS_NAME, SAFE_WEIGHTS_NAME):
            if os.path.isfile(os.path.join(checkpoint, whole)):
                return [os.path.join(checkpoint, whole)]
        indexes = [f for f in os.listdir(checkpoint) if f.endswith(".index.json")]
        if not indexes:
            raise ValueError(
                f"{checkpoint} is not a folder containing a `.index.json` file or a {WEIGHTS_NAME} or a "
                f"{SAFE_WEIGHTS_NAME} file"
            )
        if len(indexes) > 1:
            raise ValueError(f"{checkpoint} containing more than one `.index.json` file, delete the irrelevant ones.")
        index_file = os.path.join(checkpoint, indexes[0])
    else:
        raise ValueError(
            "`checkpoint` should be the path to a file containing a whole state dict, or the index of a sharded "
            f"checkpoint, or a folder containing a sharded checkpoint or the whole state dict, but got {checkpoint}."
        )
    with open(index_file) as f:
        index = json.load(f)
    weight_map = index.get("weight_map", index)
    folder = os.path.dirname(index_file) or "."
    return [os.fspath(contained_path(folder, shard, index_file)) for shard in sorted(set(weight_map.values()))]


def _load_without_device_map(
    model: nn.Module,
    checkpoint_file: str,
    strict: bool,
    full_state_dict: bool,
    broadcast_from_rank0: bool,
    model_tensors: Mapping[str, torch.Tensor],
    weights_only: bool,
) -> set[str]:
    """Load one file with torch's state-dict loading; returns the checkpoint's names."""
    physical = {t.device for t in model_tensors.values() if isinstance(t, torch.Tensor)} - {torch.device("meta")}
    if len(physical) > 1:
        whole = load_state_dict(checkpoint_file, weights_only=weights_only)
        _check_shapes(model_tensors, whole, checkpoint_file)
        model.load_state_dict(whole, strict=strict)
        return set(whole)
    # torch's loader also takes DTensor / FSDP2-sharded models, and can broadcast the full checkpoint from rank 0.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reads_file = not broadcast_from_rank0 or torch.distributed.get_rank() == 0
    loaded: dict[str, Any] = dict(load_state_dict(checkpoint_file, weights_only=weights_only)) if reads_file else {}
    _check_shapes(model_tensors, loaded, checkpoint_file)
    options = StateDictOptions(
        full_state_dict=full_state_dict, strict=strict, broadcast_from_rank0=broadcast_from_rank0
    )
    set_model_state_dict(model, loaded, options=options)
    return set(loaded)


def _keeps_fp32(name: str, keep_in_fp32_modules: Iterable[str]) -> bool:
    return any((key in name and f"{key}." in name) or key == name for key in keep_in_fp32_modules)


@dataclass(eq=False)
class _ShardLoader:
    """Places the tensors of checkpoint shards as a device map says (the state of one load)."""

    model: nn.Module
    device_map: Mapping[str, DeviceLike]
    offload_folder: str | os.PathLike[str] | None
    dtype: torch.dtype | None
    offload_state_dict: InitVar[bool]
    offload_buffers: bool
    keep_in_fp32_modules: list[str] | None
    quantize_device: DeviceLike | None = None
    offload_index: dict[str, Any] = field(default_factory=dict, init=False)
    state_dict_index: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self, offload_state_dict: bool) -> None:
        self.model_keys = set(self.model.state_dict())
        self.buffer_names = {name for name, _ in self.model.named_buffers()}
        self.state_dict_folder = tempfile.mkdtemp() if offload_state_dict else None

    def _target_dtype(self, name: str, tensor: torch.Tensor) -> torch.dtype | None:
        if self.dtype is None or not torch.is_floating_point(tensor):
            return self.dtype
        keep = self.keep_in_fp32_modules is not None and self.dtype == torch.float16
        return torch.float32 if keep and _keeps_fp32(name, self.keep_in_fp32_modules or []) else self.dtype

    def place(self, loaded: Mapping[str, torch.Tensor], skipped: set[str]) -> None:
        for name, tensor in loaded.items():
            if "SCB" in name or name in skipped:  # 8-bit statistics travel with their weight
                continue
            entry = _owning_entry(name, self.device_map)
            if entry is None:
                raise ValueError(f"{name} doesn't have any device set.")
            device = self.device_map[entry]
            dtype = self._target_dtype(name, tensor)
            statistics_name = name.replace("weight", "SCB")
            statistics = None
            if "weight" in name and statistics_name in loaded and tensor.dtype == torch.int8:
                statistics = loaded[statistics_name]
            if device == "disk" and (self.offload_buffers or name not in self.buffer_names):
                assert self.offload_folder is not None
                self._offload(name, tensor, dtype, statistics, self.offload_folder, self.offload_index)
            elif device == "cpu" and self.state_dict_folder is not None:
                self._offload(name, tensor, dtype, statistics, self.state_dict_folder, self.state_dict_index)
            else:
                target = "cpu" if device == "disk" else device
                set_module_tensor_to_device(
                    self.model, name, target, value=tensor, dtype=dtype, fp16_statistics=statistics
                )

    def _offload(
        self,
        name: str,
        tensor: torch.Tensor,
        dtype: torch.dtype | None,
        statistics: torch.Tensor | None,
        folder: str | os.PathLike[str],
        index: dict[str, Any],
    ) -> None:
        """Write ``tensor`` to ``folder`` and leave a meta placeholder; 8-bit weights are quantized first."""
        owner, tensor_name = _owner_and_name(self.model, name)
        is_int8 = self.quantize_device is not None and type(owner._parameters.get(tensor_name)).__name__ == "Int8Params"
        if is_int8 and statistics is None:  # quantize on the main device, then offload the int8 weight and its SCB
            set_module_tensor_to_device(self.model, name, self.quantize_device, value=tensor, dtype=dtype)  # type: ignore[arg-type]
            quantized = owner._parameters[tensor_name]
            assert quantized is not None
            tensor, statistics = quantized.data, quantized.SCB  # type: ignore[attr-defined]
        offload_weight(tensor, name, folder, index=index)
        if statistics is not None:
            offload_weight(statistics, name.replace("weight", "SCB"), folder, index=index)
        placeholder_dtype = torch.int8 if is_int8 else dtype or tensor.dtype
        set_module_tensor_to_device(self.model, name, "meta", dtype=placeholder_dtype)

    def finish(self) -> None:
        if self.offload_folder is not None:
            save_offload_index(self.offload_index, self.offload_folder)
        if self.state_dict_folder is not None:
            load_offloaded_weights(self.model, self.state_dict_index, self.state_dict_folder)
            shutil.rmtree(self.state_dict_folder)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, DeviceLike] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: DtypeLike | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    weights_only: bool = True,
) -> None:
    """Load a (possibly sharded) checkpoint into ``model``, sending each tensor where ``device_map`` says.

    The model still needs :func:`~lightning_accel.dispatch_model` to run across devices;
    :func:`~lightning_accel.load_checkpoint_and_dispatch` does both.

    Args:
        model: The model (typically built under ``init_empty_weights``).
        checkpoint: A checkpoint file, the ``.index.json`` of a sharded checkpoint, or a folder holding a
            ``pytorch_model.bin`` / ``model.safetensors`` or exactly one ``.index.json`` with its shards.
        device_map: Module names to devices (``"disk"`` included); without one, torch loads the state dict.
        offload_folder: Where ``"disk"`` tensors are written (required when the map has ``"disk"``).
        dtype: Load floating-point weights in this dtype.
        offload_state_dict: Keep the CPU part on disk while loading (for RAM that cannot hold it plus a shard).
        offload_buffers: Offload the ``"disk"`` modules' buffers too.
        keep_in_fp32_modules: Module names kept in float32 when ``dtype`` is float16.
        offload_8bit_bnb: Quantize bitsandbytes 8-bit weights on the main device before offloading them (with their
            ``SCB`` statistics), as :func:`~lightning_accel.utils.load_and_quantize_model` does.
        strict: Refuse checkpoint tensors the model does not have.
        full_state_dict: Without a device map, the checkpoint is a full (not sharded-tensor) state dict.
        broadcast_from_rank0: Without a device map, rank 0 reads the checkpoint and broadcasts it (needs an
            initialised process group).
        weights_only: ``False`` unpickles trusted ``torch.save`` files in full, with a warning naming each file.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a ``torch.save`` file.
        ValueError: For a map with ``"disk"`` but no ``offload_folder``, a tensor without a device, unexpected keys
            under ``strict``, an index naming a shard outside its folder, or a checkpoint path that is none of the
            above.

    """
    tied_params = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied_params:
        logger.warning(
            "The model weights are not tied. Please use the `tie_weights` method before using the "
            "`infer_auto_device` function."
        )
    if device_map is not None:
        _prepare_device_map(device_map, tied_params, offload_folder)

    files = _checkpoint_files(checkpoint)
    model_tensors = model.state_dict(keep_vars=True)
    model_keys = set(model_tensors)
    unexpected: set[str] = set()
    loader = None
    if device_map is not None:
        resolved_dtype = _as_dtype(dtype) if dtype is not None else None
        loader = _ShardLoader(
            model, device_map, offload_folder, resolved_dtype, offload_state_dict, offload_buffers,
            keep_in_fp32_modules, _main_device(device_map) if offload_8bit_bnb else None,
        )  # fmt: skip
    for checkpoint_file in files:
        if loader is None:
            unexpected |= _load_without_device_map(
                model, checkpoint_file, strict, full_state_dict, broadcast_from_rank0, model_tensors, weights_only
            )
            unexpected -= model_keys
            continue
        assert device_map is not None  # a loader exists only with a device map
        loaded = load_state_dict(checkpoint_file, device_map=device_map, weights_only=weights_only)
        unexpected |= _place_shard(loader, checkpoint_file, loaded, model_tensors, strict, checkpoint)

    if unexpected:
        logger.warning(
            f"Some weights of the model checkpoint at {checkpoint} were not used when initializing "
            f"{type(model).__name__}: {unexpected}. This may or may not be an issue - make sure that the checkpoint "
            "does not have unnecessary parameters, or that the model definition correctly corresponds to the "
            "checkpoint."
        )
    if loader is not None:
        loader.finish()
    retie_parameters(model, tied_params)
    if loader is not None:
        offloaded = set(loader.offload_index)
        offloaded |= {name for group in tied_params if offloaded.intersection(group) for name in group}
        _refuse_tensors_left_on_meta(model, offloaded, files)


def _prepare_device_map(
    device_map: Mapping[str, DeviceLike], tied_params: list[list[str]], offload_folder: str | os.PathLike[str] | None
) -> None:
    """Refuse tied weights split across devices and disk offload without a folder; create the folder."""
    check_tied_parameters_on_same_device(tied_params, device_map)
    if "disk" in device_map.values():
        if offload_folder is None:
            raise ValueError(
                "At least one of the model submodule will be offloaded to disk, please pass along an `offload_folder`."
            )
        os.makedirs(offload_folder, exist_ok=True)


def _place_shard(
    loader: _ShardLoader,
    checkpoint_file: str,
    loaded: dict[str, torch.Tensor],
    model_tensors: dict[str, Any],
    strict: bool,
    checkpoint: str | os.PathLike[str],
) -> set[str]:
    """Place one shard, read onto the devices the device map gives; returns the names the model lacks."""
    _check_shapes(model_tensors, loaded, checkpoint_file)
    extra = {name for name in loaded if name not in model_tensors and "SCB" not in name}
    if strict and extra:
        raise ValueError(
            f"The checkpoint at {checkpoint} has tensors the model does not: {sorted(extra)}; pass strict=False "
            "to ignore them."
        )
    loader.place(loaded, skipped=extra)
    return extra


def _check_shapes(
    model_tensors: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], checkpoint_file: str
) -> None:
    """Refuse a checkpoint tensor whose shape differs from the model's, naming the tensor and the file."""
    for name, tensor in loaded.items():
        current = model_tensors.get(name)
        if current is None or type(current).__name__ == "Params4bit":  # 4-bit weights are stored packed
            continue
        if current.shape != tensor.shape:
            raise ValueError(
                f"{checkpoint_file} holds {name!r} with shape {tuple(tensor.shape)}, but the model's {name!r} has "
                f"shape {tuple(current.shape)}; load a checkpoint of this model (or build the model with the "
                "configuration the checkpoint was saved with)"
            )


def _refuse_tensors_left_on_meta(model: nn.Module, offloaded: set[str], files: list[str]) -> None:
    """Refuse a load that left tensors on the meta device (no data), naming them and the files read.

    ``offloaded`` names the tensors (and their tied twins) written to the offload folder: meta placeholders there.
    """
    missing = [
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if tensor is not None and tensor.device.type == "meta" and name not in offloaded
    ]
    if missing:
        where = files[0] if len(files) == 1 else f"any of {files}"
        raise ValueError(
            f"{missing} are not in {where}, so they have no data (they stay on the meta device, and using the model "
            "would fail); load a complete checkpoint of this model, or build the model with these tensors "
            "initialised (outside init_empty_weights) if they are meant to keep their initial values"
        )


# A sharded checkpoint is a directory: torch.distributed.checkpoint shards plus this file with everything else.
METADATA_FILENAME = "meta.pt"
_MODEL_KEY = "state_dict"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (shards plus ``meta.pt``)."""
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def load_full_state_dict(
    path: str | Path, prefix: str = "", key: str = _MODEL_KEY, *, weights_only: bool = True
) -> dict[str, torch.Tensor]:
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
        weights_only: ``False`` unpickles a trusted checkpoint in full, with a warning naming it; by default a file
            holding more than tensors, numbers, strings and containers is refused naming it.

    Returns:
        A state dict of plain CPU tensors for ``nn.Module.load_state_dict``.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file of the checkpoint.

    """
    path = Path(path)
    if (path / "latest").is_file():  # a DeepSpeed checkpoint directory
        return strip_prefix(consolidate_deepspeed_checkpoint(path, weights_only=weights_only), prefix)
    if is_sharded_checkpoint(path):
        checkpoint = read_sharded_entries(path, {key}, weights_only)
    elif path.is_file():
        checkpoint = read_checkpoint_file(path, lambda p: load(p, map_location="cpu", weights_only=weights_only))
    else:
        raise FileNotFoundError(f"No checkpoint at {str(path)!r}: expected a checkpoint file or directory.")
    if key not in checkpoint:
        raise KeyError(
            f"The checkpoint at {str(path)!r} has no {key!r} entry; pass `key=` (one of {sorted(checkpoint)})."
        )
    return strip_prefix(checkpoint[key], prefix)


def consolidate_deepspeed_checkpoint(
    path: str | os.PathLike[str], tag: str | None = None, prefix: str = "", *, weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """Turn a DeepSpeed checkpoint directory into one full state dict for a plain ``nn.Module``.

    Works in a single process, without the strategy. It reads ``pytorch_model.bin`` when the checkpoint has one
    (written with ``zero3_save_16bit_model=True``; it holds the weights in the training dtype), and otherwise
    merges the ZeRO shards into fp32 weights with DeepSpeed's ``zero_to_fp32`` utilities.

    Args:
        path: The directory ``trainer.save_checkpoint`` (or ``fabric.save``) wrote.
        tag: The DeepSpeed tag (sub-directory) to read; by default the one named in the ``latest`` file.
        prefix: Keep only the keys starting with this prefix and strip it, e.g. ``"net."`` to load a
            LightningModule's ``self.net`` into a plain module.
        weights_only: ``False`` unpickles a trusted folder's files in full, with a warning naming each; by default
            every file DeepSpeed would unpickle is first read weights-only, and one holding more is refused.

    Returns:
        Parameter and buffer names of the trained module (the LightningModule for the Trainer) mapped to tensors.

    Raises:
        FileNotFoundError: If ``path`` is not a DeepSpeed checkpoint directory.
        KeyError: If no key starts with ``prefix``.
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file of the folder.
        ValueError: If the ``latest`` file names a tag outside ``path``.

    """
    return strip_prefix(_read_deepspeed_checkpoint(Path(path), tag, weights_only), prefix)


def deepspeed_tag_folder(root: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The folder of DeepSpeed checkpoint ``root`` holding ``tag`` (by default the tag its ``latest`` file names).

    Raises:
        ValueError: If the tag names a folder outside ``root``, naming the tag, ``root`` and the ``latest`` file.

    """
    latest = Path(root) / "latest"
    if tag is None:
        tag = read_checkpoint_file(latest, lambda p: p.read_text().strip())
    return contained_path(root, tag, latest)


def deepspeed_globals() -> list[type]:
    """The non-tensor types DeepSpeed writes in its checkpoint files, which a weights-only load of them allows.

    ZeRO's optimizer-state files hold its stage enum, fragment addresses and the loss scaler (plain data classes,
    rebuilt without running code); nothing else of DeepSpeed's is allowed.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def check_deepspeed_files(folder: Path, weights_only: bool = True) -> None:
    """Read every ``.pt`` file of a DeepSpeed tag folder weights-only (memory-mapped), before DeepSpeed unpickles it.

    DeepSpeed's own readers (its checkpoint engine, ``zero_to_fp32``) unpickle in full; what a weights-only load
    accepts is safe to hand them. With ``weights_only=False`` each file is only named in a warning.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.

    """
    allowed = deepspeed_globals() if weights_only else []
    for file in sorted(folder.glob("*.pt")):
        if not weights_only:
            warn_full_unpickling(file)
            continue
        read_checkpoint_file(file, lambda p: load(p, map_location="cpu", mmap=True, extra_globals=allowed))


def _read_deepspeed_checkpoint(root: Path, tag: str | None, weights_only: bool) -> dict[str, torch.Tensor]:
    full = root / WEIGHTS_NAME
    if full.is_file() and tag is None:
        return dict(read_checkpoint_file(full, lambda p: load(p, map_location="cpu", weights_only=weights_only)))
    if not (root / "latest").is_file() and tag is None:
        raise FileNotFoundError(
            f"{root} is not a DeepSpeed checkpoint directory (it has neither {WEIGHTS_NAME} nor a 'latest' file)."
            " Pass the directory that trainer.save_checkpoint wrote."
        )
    shard_dir = deepspeed_tag_folder(root, tag)
    if not any("zero_pp_rank" in f.name for f in shard_dir.glob("*optim_states.pt")):
        return _stage0_state_dict(shard_dir, weights_only)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_deepspeed_files(shard_dir, weights_only)
    tag = shard_dir.relative_to(root.resolve()).as_posix()
    return dict(
        read_checkpoint_file(shard_dir, lambda _: get_fp32_state_dict_from_zero_checkpoint(os.fspath(root), tag=tag))
    )


def _stage0_state_dict(shard_dir: Path, weights_only: bool) -> dict[str, torch.Tensor]:
    """Without ZeRO, rank 0's model-states file holds the whole module."""
    files = sorted(shard_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"No DeepSpeed model-states file in {shard_dir}.")
    read = lambda p: load(p, map_location="cpu", weights_only=weights_only, extra_globals=deepspeed_globals())  # noqa: E731
    state = read_checkpoint_file(files[0], read)
    return dict(state["module"])
