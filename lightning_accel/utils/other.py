"""Accelerate's ``save``/``load`` (write once per run or node, read with ``weights_only``) and model unwrapping."""

from __future__ import annotations

import os
import platform
import re
import socket
from types import MethodType
from typing import Any, cast

import torch
from packaging.version import Version

from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState

__all__ = [
    "check_os_kernel",
    "extract_model_from_parallel",
    "get_free_port",
    "get_model_tp_size",
    "is_compiled_module",
    "is_port_in_use",
    "load",
    "save",
    "wait_for_everyone",
]

logger = get_logger(__name__)
_MIN_LINUX_KERNEL = "5.5.0"


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
        torch.save(obj, f)
        return
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise TypeError(
            f"safe_serialization=True saves a dict of tensors, got {type(obj).__name__}; pass"
            " safe_serialization=False to pickle other objects."
        )
    from safetensors.torch import save_file

    tensors = _without_aliases(obj)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.fspath(f), metadata={"format": "pt"})


def _without_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with one entry per shared storage (the first name kept), warning about the names dropped.

    safetensors refuses tensors that share memory (tied weights); as in Accelerate, the later names are left out and
    the model's tying restores them on load. The caller's dict is not changed.
    """
    from lightning_accel.utils.modeling_tensors import id_tensor_storage

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


def load(f: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller passes ``weights_only=False``."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def wait_for_everyone() -> None:
    """Block until every process gets here (a no-op with one process)."""
    PartialState().wait_for_everyone()


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` was returned by ``torch.compile``."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's module inside Fabric's, DDP's or DataParallel's wrappers (and ``torch.compile``'s unless kept).

    A compiled parallel module (``torch.compile(DDP(model))``) keeps its compiled wrapper with ``keep_torch_compile``,
    around the unwrapped module.

    Autocast lives in the precision plugin here, not in a forward wrapper. Still, as in Accelerate, a module whose
    ``forward`` was wrapped (e.g. with :func:`~lightning_accel.utils.operations.convert_outputs_to_fp32`) after
    recording the original as ``_original_forward`` gets that forward back with ``keep_fp32_wrapper=False``.
    """
    from lightning.fabric.wrappers import _FabricModule

    if isinstance(model, _FabricModule):
        model = model.module
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = cast(torch.nn.Module, compiled._orig_mod)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = cast(torch.nn.Module, model.module)
    if not keep_fp32_wrapper:
        _restore_original_forward(model)
    if compiled is None or not keep_torch_compile:
        return model
    compiled._orig_mod = model  # the compiled wrapper kept, around the unwrapped module (as Accelerate does)
    return compiled


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
