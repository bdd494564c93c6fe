"""Accelerate's memory helpers: retry with smaller batches on out-of-memory, release references."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

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
