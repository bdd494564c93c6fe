"""Accelerate's memory helpers: retry with smaller batches on out-of-memory, release references."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

# A device-map entry: an accelerator index, a device string, or a torch.device.
DeviceLike: TypeAlias = int | str | torch.device


__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

# Messages of out-of-memory errors (CUDA/HIP/XPU, MPS, cuDNN, CPU, HPU) that a smaller batch may avoid.
_OOM_MESSAGES = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached accelerator memory to the device (after a garbage collection if asked)."""
    if garbage_collection:
        gc.collect()
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Clear the device cache once the caller has dropped its references to ``objects``.

    Returns one ``None`` per object, to assign over the caller's names (``model, optimizer = release_memory(...)``).
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch may avoid."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(message in str(exception.args[0]) for message in _OOM_MESSAGES)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorate ``function(batch_size, ...)`` to retry with a smaller batch size after out-of-memory errors.

    The batch size starts at ``starting_batch_size`` and shrinks to ``int(0.9 * batch_size)`` (or what
    ``reduce_batch_size_fn()`` returns) after each out-of-memory error; other errors propagate.

    Raises:
        TypeError: If the caller passes the batch size itself.
        RuntimeError: When the batch size reaches zero.

    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        if len(inspect.signature(function).parameters) < len(args) + 1:
            raise TypeError(
                f"{function.__name__} got the batch size as an argument; call it without: the decorator passes it."
            )
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:
                if not should_reduce_batch_size(err):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = smaller()
        raise RuntimeError("No executable batch size found, reached zero.")

    return wrapper


def resolve_device(device: DeviceLike) -> torch.device:
    """The ``torch.device`` a device-map entry names; an ``int`` is an index on the machine's accelerator.

    Raises:
        ValueError: For ``"disk"`` (a placement, not a device), a string torch cannot read, or a device this machine
            lacks (an index on a machine without an accelerator, ``"cuda:3"`` with two GPUs), naming the devices it has.

    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None:
            raise ValueError(
                f"Device {device} is an accelerator index, but torch sees no accelerator on this machine; "
                "use 'cpu' (or 'disk') in the device map instead."
            )
        _check_device_exists(device, torch.device(accelerator.type, device))
        return torch.device(accelerator.type, device)
    if device == "disk":
        raise ValueError("'disk' is where offloaded weights are stored, not a device tensors can be placed on.")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"Device {device!r} is not a device torch knows; use an accelerator index (0, 1, ...), a device string "
            "such as 'cuda:0', 'cpu' or 'disk'"
        ) from None
    _check_device_exists(device, resolved)
    return resolved


def _device_count(device_type: str) -> int:
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "device_count"):
        return 0
    available = getattr(module, "is_available", lambda: True)
    return int(module.device_count()) if available() else 0


def _check_device_exists(given: DeviceLike, device: torch.device) -> None:
    """Refuse an accelerator device this machine lacks (torch would fail later, deep inside, without naming it)."""
    if device.type in ("cpu", "meta"):
        return
    count = _device_count(device.type)
    if count and (device.index is None or device.index < count):
        return
    existing = [*(f"{device.type}:{index}" for index in range(count)), "cpu", "disk"]
    raise ValueError(
        f"Device {given!r} does not exist on this machine; the devices here are {existing}. Change the device map "
        "to name one of them"
    )
