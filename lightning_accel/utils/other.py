"""Accelerate's ``accelerate.utils.other``: ``save``/``load``, model unwrapping, compiled regions, small helpers.

``save`` writes once per run or node, ``load`` reads with ``weights_only``; the rest are Accelerate's helpers under its
names and signatures (model inspection, dictionary merging, attribute paths, sizes in words).

Beside ``save``, the package's checkpoint writers: torch's own writer turns a full disk or a file over the size limit
into ``unexpected pos 19712 vs 19600``, and safetensors into ``I/O error ... (os error 28)``. :func:`torch_save` and
:func:`safetensors_save` write through a file this package opens, so the operating system's error reaches us, and
:func:`writing` turns it into a :class:`CheckpointWriteError`: an ``OSError`` with the same ``errno`` whose message
names the file, the folder, the cause (``ENOSPC``, ``EFBIG``, ``EDQUOT``) and what to do. Where a writer we do not
control failed (DeepSpeed's and DCP's files), :func:`write_error` finds the cause from the machine (free space, the
process's file size limit) and the file from the folder (the one written last). Inside :func:`observing_writes` the
two writers show every file to a :class:`WriteObserver` (the checkpoint manifest checksums the bytes as they are
written, instead of reading the files back).
"""

from __future__ import annotations

import codecs
import collections
import errno
import functools
import os
import pickle
import platform
import re
import shutil
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import MethodType
from typing import IO, Any, BinaryIO, Protocol, cast

import numpy as np
import torch
from packaging.version import Version

from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState

__all__ = [
    "TORCH_SAFE_GLOBALS",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "WriteObserver",
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "convert_bytes",
    "extract_model_from_parallel",
    "get_free_port",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "get_pretty_name",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_compiled_module",
    "is_port_in_use",
    "is_repeated_blocks",
    "load",
    "merge_dicts",
    "model_has_dtensor",
    "observing_writes",
    "recursive_getattr",
    "safetensors_save",
    "save",
    "torch_save",
    "wait_for_everyone",
    "write_error",
    "writing",
]

logger = get_logger(__name__)
_MIN_LINUX_KERNEL = "5.5.0"


# --- checkpoint writes that name what failed --------------------------------------------------------------------------

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EFBIG: "the file grew past the largest file this process may write",
    errno.EDQUOT: "the disk quota is exhausted",
}
_RUST_OS_ERROR = re.compile(r"os error (\d+)")
_NEARLY_FULL = 1 << 20  # bytes left on a disk that a failed write filled


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written: ``errno`` is the operating system's, ``path`` the file.

    Args:
        code: ``errno.ENOSPC``, ``errno.EFBIG`` or ``errno.EDQUOT``.
        path: The file being written.

    """

    def __init__(self, code: int, path: Path) -> None:
        self.code, self.path = code, path
        super().__init__(code, _message(code, path))

    def __reduce__(self) -> tuple[type[CheckpointWriteError], tuple[int, Path]]:  # crosses process boundaries
        return type(self), (self.code, self.path)

    def __str__(self) -> str:
        return str(self.strerror)


def _message(code: int, path: Path) -> str:
    folder = path.parent
    name = errno.errorcode.get(code, str(code))
    hint = {
        errno.ENOSPC: f"free space on that disk ({_free_bytes(folder)} bytes free now) or save elsewhere",
        errno.EFBIG: f"raise the limit ({_size_limit()}) or save smaller files (max_shard_size)",
        errno.EDQUOT: "free space within your quota or save elsewhere",
    }[code]
    return f"Could not write {path.name} in the folder {folder}: {_CAUSES[code]} ({name}); {hint}."


def _free_bytes(folder: Path) -> int | str:
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return "unknown"


def _size_limit() -> str:
    soft = _file_size_limit()
    return "the filesystem's largest file" if soft is None else f"ulimit -f: {soft} bytes for this process"


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _os_error_code(error: BaseException) -> int | None:
    """The ``errno`` of a full disk, file size limit or quota anywhere in ``error``'s chain of causes."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _CAUSES:
            return current.errno
        if (match := _RUST_OS_ERROR.search(str(current))) and int(match[1]) in _CAUSES:
            return int(match[1])
        current = current.__cause__ or current.__context__
    return None


def _cause_from_machine(path: Path) -> int | None:
    """Why writing ``path`` failed when the error does not say: a full disk, or the file at the size limit."""
    if isinstance(free := _free_bytes(path.parent), int) and free < _NEARLY_FULL:
        return errno.ENOSPC
    limit = _file_size_limit()
    if limit is not None and path.is_file() and path.stat().st_size >= limit:
        return errno.EFBIG
    return None


def _newest_file(folder: Path) -> Path | None:
    files = [entry for entry in folder.rglob("*") if entry.is_file()] if folder.is_dir() else []
    return max(files, key=lambda entry: entry.stat().st_mtime_ns, default=None)


def write_error(error: BaseException, folder: Path, path: Path | None = None) -> CheckpointWriteError | None:
    """The :class:`CheckpointWriteError` that ``error``, raised while writing into ``folder``, amounts to.

    Args:
        error: What the writer raised.
        folder: The folder being written.
        path: The file being written, where known; else the file of ``folder`` written last.

    Returns:
        ``None`` when ``error`` is no full disk, file size limit or quota (nor its cause): raise it as it is.

    """
    if isinstance(error, CheckpointWriteError):
        return error
    target = path or _newest_file(folder) or folder
    code = _os_error_code(error)
    if code is None:
        code = _cause_from_machine(target)
    return None if code is None else CheckpointWriteError(code, target)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Raise a full disk, a file size limit or a quota met while writing ``path`` as :class:`CheckpointWriteError`."""
    try:
        yield
    except Exception as error:
        named = write_error(error, path.parent, path)
        if named is None or named is error:
            raise
        raise named from error


class WriteObserver(Protocol):
    """What sees the files :func:`torch_save` and :func:`safetensors_save` write inside :func:`observing_writes`."""

    def stream(self, path: Path, file: BinaryIO) -> BinaryIO:
        """The file object to write ``path``'s bytes through (it passes them on to ``file``)."""
        ...

    def written(self, path: Path) -> None:
        """``path`` is complete (written through :meth:`stream`, or by a library that writes the file itself)."""
        ...


_OBSERVER: ContextVar[WriteObserver | None] = ContextVar("lightning_accel_write_observer", default=None)


@contextmanager
def observing_writes(observer: WriteObserver) -> Iterator[None]:
    """Show ``observer`` every file the package's writers write in this context (this thread's, not its children)."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def torch_save(obj: object, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, a failure named by :func:`writing`."""
    target = Path(path)
    observer = _OBSERVER.get()
    with writing(target), open(target, "wb") as file:
        torch.save(obj, file if observer is None else observer.stream(target, file))
    if observer is not None:
        observer.written(target)


def safetensors_save(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write ``tensors`` as a safetensors file (metadata ``{"format": "pt"}``), a failure named by :func:`writing`."""
    from safetensors.torch import save_file

    target = Path(path)
    with writing(target):
        save_file(dict(tensors), os.fspath(target), metadata={"format": "pt"})
    if (observer := _OBSERVER.get()) is not None:
        observer.written(target)


# --- Accelerate's helpers ---------------------------------------------------------------------------------------------


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
        torch_save(obj, f)
        return
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise TypeError(
            f"safe_serialization=True saves a dict of tensors, got {type(obj).__name__}; pass"
            " safe_serialization=False to pickle other objects."
        )
    tensors = _without_aliases(obj)
    safetensors_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, f)


def _without_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with one entry per shared storage (the first name kept), warning about the names dropped.

    safetensors refuses tensors that share memory (tied weights); as in Accelerate, the later names are left out and
    the model's tying restores them on load. The caller's dict is not changed.
    """
    seen: set[tuple[torch.device, int, int]] = set()
    dropped: list[str] = []
    for name, tensor in state_dict.items():
        key = id_tensor_storage(tensor)
        if key in seen and key[1] != 0:  # pointer 0: meta or storage-less tensors, which alias nothing
            dropped.append(name)
        seen.add(key)
    if dropped:
        logger.warning(
            f"Removed shared tensor {dropped} while saving to safetensors: each shares memory with an entry kept in "
            "the file (tied weights); re-tie them after loading, as the model's constructor does.",
            main_process_only=False,
        )
    return {name: tensor for name, tensor in state_dict.items() if name not in dropped}


def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` ready for safetensors: one name per shared storage, every tensor contiguous.

    As in Accelerate, the later names of tensors sharing memory (tied weights) are deleted from ``state_dict`` itself,
    with a warning naming them; string values (bitsandbytes metadata) are kept. Returns a new dict of contiguous
    tensors.
    """
    names_by_storage: dict[Any, list[str]] = collections.defaultdict(list)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, str):
            names_by_storage[id_tensor_storage(tensor)].append(name)
    removed: set[str] = set()
    for names in names_by_storage.values():
        for name in [n for n in names if n in state_dict][1:]:
            removed.add(name)
            del state_dict[name]
    if removed:
        logger.warning(
            f"Removed shared tensor {removed} while saving: each shares memory with an entry kept in the file (tied "
            "weights); check that reloading does not warn about them"
        )
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


# What ``load`` lets ``weights_only`` rebuild besides tensors: numpy arrays and dtypes (numpy's RNG state) and
# ``codecs.encode`` (how Python pickles bytes), Accelerate's list.
# numpy 2 renamed ``numpy.core`` to ``numpy._core``; numpy 1.26 already has a ``numpy._core`` stub, but its arrays
# still pickle ``numpy.core.multiarray._reconstruct`` and the stub's ``multiarray`` is not loaded, so ask the version.
_NUMPY_CORE: Any = np.core if np.lib.NumpyVersion(np.__version__) < "2.0.0" else getattr(np, "_core")  # noqa: B009
TORCH_SAFE_GLOBALS: list[Any] = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
if hasattr(np, "dtypes"):  # numpy 1.25 and newer
    TORCH_SAFE_GLOBALS.append(np.dtypes.UInt32DType)


class UnsafeCheckpointError(ValueError):
    """A weights-only load refused a checkpoint file: rebuilding what it holds would run code the file names."""


def unsafe_checkpoint_error(path: str | os.PathLike[str], err: pickle.UnpicklingError) -> UnsafeCheckpointError:
    """The refusal of ``path`` as unsafe, naming the file, torch's reason and the opt-in ``weights_only=False``."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else repr(err))
    return UnsafeCheckpointError(
        f"Refused to load {os.fspath(path)} as unsafe: a weights-only load cannot rebuild what it holds ({reason}),"
        " and unpickling it in full would run any code it names. If you trust this checkpoint, load it with"
        " weights_only=False."
    )


def is_weights_only_refusal(err: BaseException) -> bool:
    """Whether ``err`` is torch's refusal of a file by a weights-only load (not a truncated or corrupt file)."""
    return isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err)


def warn_full_unpickling(path: str | os.PathLike[str], stacklevel: int = 2) -> None:
    """Warn that ``path`` is unpickled in full (``weights_only=False``), naming it."""
    warnings.warn(
        f"Loading {os.fspath(path)} with weights_only=False: unpickling runs any code the file holds; do this only"
        " for a checkpoint you trust.",
        stacklevel=stacklevel + 1,
    )


def load(
    f: str | os.PathLike[str] | IO[bytes],
    map_location: Any = None,
    *,
    weights_only: bool = True,
    extra_globals: Sequence[Callable[..., object]] = (),
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.load``, weights-only unless the caller passes ``weights_only=False``.

    The one place this package loads a pickled checkpoint file. As in Accelerate, the numpy types of
    :data:`TORCH_SAFE_GLOBALS` are allowed while it loads (so ``random_states_{i}.pkl`` loads weights-only), with
    ``extra_globals`` (the exact types a caller's file holds); the allowed globals are restored afterwards. A file
    that needs more than the allowlist is refused naming the file and the opt-in; the opt-in warns naming the file.

    Args:
        f: The file (or an open binary file, with ``name``).
        map_location: As for ``torch.load``.
        weights_only: ``False`` unpickles the file in full (only for a checkpoint you trust), with a warning.
        extra_globals: Types a weights-only load may rebuild besides tensors, containers and numpy's.
        name: How the refusal and the warning name the file (default: ``f``).
        **kwargs: For ``torch.load`` (``mmap``, ...).

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses the file.

    """
    label = name if name is not None else os.fspath(cast("str | os.PathLike[str]", f))
    if not weights_only:
        warn_full_unpickling(label)
        return torch.load(f, map_location=map_location, weights_only=False, **kwargs)
    with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, *extra_globals]):
        try:
            return torch.load(f, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise unsafe_checkpoint_error(label, err) from err


class _AllowlistUnpickler(pickle.Unpickler):
    """A plain-pickle unpickler that rebuilds only the globals ``allowed`` accepts (``pickle``'s own recipe)."""

    def __init__(self, file: IO[bytes], allowed: Callable[[str, str], bool]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if self._allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"WeightsUnpickler error: Unsupported global: GLOBAL {module}.{name} is not allowed"
        )


def load_pickle(f: str | os.PathLike[str], allowed: Callable[[str, str], bool]) -> Any:
    """Unpickle a plain pickle file (not a ``torch.save`` archive) rebuilding only the globals ``allowed`` accepts.

    For the plain pickles engines write besides their tensors (``torch.distributed.checkpoint``'s ``.metadata``),
    which torch's weights-only unpickler cannot read; the refusal is :func:`load`'s.

    Args:
        f: The file.
        allowed: Whether ``(module, name)`` may be rebuilt.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If the file names a global ``allowed`` refuses.

    """
    with open(f, "rb") as file:
        try:
            return _AllowlistUnpickler(file, allowed).load()
        except pickle.UnpicklingError as err:
            raise unsafe_checkpoint_error(f, err) from err


def wait_for_everyone() -> None:
    """Block until every process gets here (a no-op with one process)."""
    PartialState().wait_for_everyone()


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` was returned by ``torch.compile``."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its submodules was returned by ``torch.compile`` (a module without children: no)."""
    if not module._modules:
        return False
    return any(is_compiled_module(submodule) for submodule in module.modules())


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a non-empty ``ModuleList`` whose children are all of its first child's class."""
    return (
        isinstance(module, torch.nn.ModuleList)
        and len(module) > 0
        and all(isinstance(m, module[0].__class__) for m in module)
    )


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds, at any depth, a run of repeated blocks (see :func:`is_repeated_blocks`)."""
    if not module._modules:
        return False
    return any(is_repeated_blocks(submodule) for submodule in module.modules())


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Accelerate's regional compilation: a copy of ``module`` whose repeated blocks are each ``torch.compile``-d.

    Each block of a ``ModuleList`` of one class is compiled on its own (they share code, so dynamo's cache serves all
    but the first); the other leaves of the tree are compiled whole. The containers above are shallow copies (the
    same parameters), and ``module`` itself is left unchanged; the copy keeps it as ``_orig_mod`` in its
    ``__dict__``, which :func:`extract_model_from_parallel` uses to unwrap it.

    Args:
        module: The model to compile.
        **compile_kwargs: ``torch.compile`` arguments (``backend``, ``mode``, ...).

    Returns:
        The model with compiled regions (``module`` itself is not modified).

    """

    def compile_tree(node: torch.nn.Module) -> torch.nn.Module:
        if is_repeated_blocks(node):
            blocks = torch.nn.ModuleList()
            for block in cast(torch.nn.ModuleList, node):
                blocks.append(cast(torch.nn.Module, torch.compile(block, **compile_kwargs)))
            return blocks
        if not has_repeated_blocks(node):
            return cast(torch.nn.Module, torch.compile(node, **compile_kwargs))
        copy = node.__class__.__new__(node.__class__)
        copy.__dict__.update(node.__dict__)
        for name, value in list(copy.__dict__.items()):  # methods bound to the original, rebound to the copy
            if hasattr(value, "__func__") and getattr(value, "__self__", None) is node:
                copy.__dict__[name] = MethodType(value.__func__, copy)
        copy._modules = {}
        for name, child in node.named_children():
            copy.add_module(name, compile_tree(child))
        return copy

    compiled = compile_tree(module)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module
    return compiled


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation in place (``module.compile()``), as for a ``DeepSpeedEngine``'s module.

    The repeated blocks are compiled one by one, the other leaves whole; ``module`` keeps its identity and hooks.
    """
    if is_repeated_blocks(module):
        for block in cast(torch.nn.ModuleList, module):
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions_deepspeed(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """:func:`compile_regions_deepspeed` for FSDP2, returning ``module``: in place, so ``fully_shard``'s hooks run."""
    compile_regions_deepspeed(module, **compile_kwargs)
    return module


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (sharded by FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _parallel_wrappers() -> tuple[type, ...]:
    """The wrapper classes whose ``.module`` is the wrapped model: DDP, DataParallel, FSDP1, a DeepSpeed engine."""
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    engine = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)  # only if a run imported DeepSpeed
    if isinstance(engine, type):
        wrappers += (engine,)
    return wrappers


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> torch.nn.Module:
    """The user's module inside Fabric's, DDP's, DataParallel's, FSDP1's or DeepSpeed's wrappers.

    A compiled parallel module (``torch.compile(DDP(model))``) keeps its compiled wrapper with ``keep_torch_compile``,
    around the unwrapped module; so does a model from :func:`compile_regions` (its ``_orig_mod``).

    Autocast lives in the precision plugin here, not in a forward wrapper. Still, as in Accelerate, a module whose
    ``forward`` was wrapped (e.g. with :func:`~lightning_accel.utils.operations.convert_outputs_to_fp32`) after
    recording the original as ``_original_forward`` gets that forward back with ``keep_fp32_wrapper=False``, and a
    model converted to Transformer Engine layers (``_converted_to_transformer_engine``) is converted back.

    Args:
        model: The prepared (wrapped) model.
        keep_fp32_wrapper: Keep a forward wrapper recorded with ``_original_forward``.
        keep_torch_compile: Keep the ``torch.compile`` wrapper (or the regionally compiled copy).
        recursive: Also unwrap every ``.module`` chain below and every child wrapped the same way, in place (as
            Accelerate does for FSDP on XLA, whose wrappers sit on sublayers).

    """
    from lightning.fabric.wrappers import _FabricModule

    if isinstance(model, _FabricModule):
        model = model.module
    compiled: Any = None
    if is_compiled_module(model):
        compiled = model
        model = cast(torch.nn.Module, compiled._orig_mod)
    elif has_compiled_regions(model) and "_orig_mod" in model.__dict__:
        compiled = model
        model = cast(torch.nn.Module, model.__dict__["_orig_mod"])
    wrappers = _parallel_wrappers()
    while isinstance(model, wrappers):
        model = cast(torch.nn.Module, model.module)
    if recursive:
        model = _unwrap_recursively(model)
    if not keep_fp32_wrapper:
        _restore_original_forward(model)
        if getattr(model, "_converted_to_transformer_engine", False):
            from lightning_accel.utils.transformer_engine import convert_model

            convert_model(model, to_transformer_engine=False)
    if compiled is None or not keep_torch_compile:
        return model
    if is_compiled_module(compiled):
        compiled._orig_mod = model  # the compiled wrapper kept, around the unwrapped module (as Accelerate does)
    else:
        compiled.__dict__["_orig_mod"] = model
    return cast(torch.nn.Module, compiled)


def _unwrap_recursively(module: Any) -> Any:
    """Follow ``.module`` down, then do the same for every child, replacing it in place (Accelerate's ``recursive``)."""
    inner = _unwrap_recursively(module.module) if hasattr(module, "module") else module
    for name, child in inner.named_children():
        setattr(inner, name, _unwrap_recursively(child))
    return inner


def _restore_original_forward(model: torch.nn.Module) -> None:
    """Undo forward wrappers down to the ``_original_forward`` recorded on ``model`` (nothing when none is)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    target = getattr(original, "__func__", original)
    forward: Any = model.forward
    while hasattr(forward, "__wrapped__") and getattr(forward, "__func__", forward) is not target:
        forward = forward.__wrapped__
    function = getattr(forward, "__func__", forward)
    if function is type(model).forward:
        model.__dict__.pop("forward", None)  # the class's own forward: drop the instance attribute
    else:
        model.forward = MethodType(function, model)


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a ``transformers`` model was sharded with, ``None`` when it was not.

    transformers before 5 keeps it on the model (``model.tp_size``); from 5 on, in the model config's
    ``distributed_config`` (a dict or an object with a ``tp_size`` attribute).
    """
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return int(tp_size)
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        found = distributed_config.get("tp_size")
    else:
        found = getattr(distributed_config, "tp_size", None)
    return None if found is None else int(found)


def check_os_kernel() -> None:
    """Warn (on the main process) when a Linux kernel is older than 5.5, on which distributed runs can hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"\d+\.\d+\.\d+", info.release)
    if match is None:
        return
    if Version(match.group()) < Version(_MIN_LINUX_KERNEL):
        logger.warning(
            f"Linux kernel {match.group()} is older than {_MIN_LINUX_KERNEL}, the oldest on which distributed runs "
            "are known not to hang; upgrade the kernel to that version or newer.",
            main_process_only=True,
        )


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something accepts connections on ``localhost:port`` (default 29500, torchrun's port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", 29500 if port is None else port)) == 0


def get_free_port() -> int:
    """A TCP port the operating system reports free right now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def get_pretty_name(obj: Any) -> str:
    """``obj``'s qualified name, or its class's for an instance (what Accelerate's logs call it)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return str(obj.__qualname__)
    if hasattr(obj, "__name__"):
        return str(obj.__name__)
    return str(obj)


def merge_dicts(source: dict[Any, Any], destination: dict[Any, Any]) -> dict[Any, Any]:
    """Merge ``source`` into ``destination`` in place, recursing into nested dicts; returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit under 1024 of it, binary steps: ``convert_bytes(1536)`` is ``"1.5 KB"``."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer")``.

    Raises:
        AttributeError: If a name along the path is missing.

    """
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_children_bottom_up(
    model: torch.nn.Module, return_fqns: bool = False
) -> list[torch.nn.Module] | list[tuple[str, torch.nn.Module]]:
    """Every module of ``model``, children before their parents, ``model`` itself last.

    The order is Accelerate's (a depth-first walk, reversed), which FSDP2 wraps in. With ``return_fqns`` the items are
    ``(qualified name, module)`` pairs, the root's name being ``""``.
    """
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    ordered: list[tuple[str, torch.nn.Module]] = []
    while stack:
        prefix, current = stack.pop()
        for name, child in current.named_children():
            if isinstance(child, torch.nn.Module):
                stack.append((f"{prefix}.{name}" if prefix else name, child))
        ordered.append((prefix, current))
    ordered.reverse()
    if return_fqns:
        return ordered
    return [module for _, module in ordered]


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """An identifier of the storage behind ``tensor``: ``(device, data pointer, size in bytes)``.

    Tensors sharing memory share the identifier while they live; meta tensors all get pointer 0.
    """
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.device, 0, tensor.nelement() * tensor.element_size()
