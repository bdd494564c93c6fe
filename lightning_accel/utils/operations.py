"""Accelerate's tensor operations: collectives and helpers that recurse through nested lists, tuples and dicts.

Collectives use the default ``torch.distributed`` process group (created by the ``Accelerator``'s strategy) and run
under its timeout; without a process group, or with one process, they return their input (or a copy).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]

_REDUCTIONS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor``."""
    return isinstance(value, Tensor)


def is_namedtuple(value: Any) -> bool:
    """Whether ``value`` is an instance of a ``collections.namedtuple`` class."""
    return isinstance(value, tuple) and hasattr(value, "_fields") and hasattr(value, "_asdict")


def _rebuild(container: Sequence[Any], items: list[Any]) -> Any:
    """A sequence of ``container``'s type holding ``items`` (namedtuples are rebuilt field by field)."""
    cls: Any = type(container)
    return cls(*items) if is_namedtuple(container) else cls(items)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the container structure.

    Args:
        func: Called as ``func(leaf, *args, **kwargs)``.
        data: A leaf, or nested lists, tuples (namedtuples too) and mappings of leaves.
        *args: Extra positional arguments for ``func``.
        test_type: Which leaves ``func`` applies to (default: tensors).
        error_on_other_type: Raise on other leaves instead of returning them unchanged.
        **kwargs: Extra keyword arguments for ``func``.

    Raises:
        TypeError: For a leaf that fails ``test_type`` when ``error_on_other_type`` is set.

    """

    def apply(value: Any) -> Any:
        return recursively_apply(
            func, value, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
        )

    if isinstance(data, (list, tuple)):
        return _rebuild(data, [apply(item) for item in data])
    if isinstance(data, Mapping):
        return type(data)({key: apply(value) for key, value in data.items()})  # type: ignore[call-arg]
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's wording, which its own tests (and so user code matching on it) check word for word.
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested"
            f" list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` should"
            " be passed."
        )
    return data


def send_to_device(
    tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys: str | Sequence[str] | None = None
) -> Any:
    """Move every tensor (and every object with a ``to`` method) in ``tensor`` to ``device``.

    Args:
        tensor: The data to move.
        device: Target device.
        non_blocking: Asynchronous copies (with pinned memory).
        skip_keys: Mapping keys whose values are left where they are.

    """
    if isinstance(tensor, Tensor):
        return tensor.to(device, non_blocking=non_blocking)
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if isinstance(tensor, (list, tuple)):
        return _rebuild(tensor, [send_to_device(t, device, non_blocking, skip_keys) for t in tensor])
    if isinstance(tensor, Mapping):
        moved = {
            key: value if key in skip else send_to_device(value, device, non_blocking, skip_keys)
            for key, value in tensor.items()
        }
        return type(tensor)(moved)  # type: ignore[call-arg]
    if hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a `.to` without `non_blocking`
            return tensor.to(device)
    return tensor


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DistributedOperationException(Exception):
    """Processes called a collective with tensors of different shapes (reported in ``ACCELERATE_DEBUG_MODE``)."""


def _shapes(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data)


def _verify_shapes(operation: str, data: Any) -> None:
    """In debug mode, compare the input shapes of every process first, and raise on a mismatch instead of hanging.

    Raises:
        DistributedOperationException: Listing each process's shapes.

    """
    from lightning_accel.state import PartialState

    if _world_size() == 1 or not getattr(PartialState(), "debug", False):
        return
    parts: list[Any] = [None] * _world_size()
    dist.all_gather_object(parts, _shapes(data))
    if any(part != parts[0] for part in parts):
        listing = "\n".join(f"  - process {rank}: {shape}" for rank, shape in enumerate(parts))
        raise DistributedOperationException(
            f"{operation} needs the same shapes on every process (pad_across_processes first), got:\n{listing}"
        )


def gather(tensor: Any) -> Any:
    """Concatenate ``tensor`` from every process along dim 0 (0-d tensors become 1-d first).

    Every process must call this with tensors of the same shape (use :func:`pad_across_processes` first otherwise).
    """

    def gather_one(value: Tensor) -> Tensor:
        value = value[None] if value.ndim == 0 else value
        if _world_size() == 1:
            return value
        parts = [torch.empty_like(value) for _ in range(_world_size())]
        dist.all_gather(parts, value.contiguous())
        return torch.cat(parts, dim=0)

    _verify_shapes("gather", tensor)
    return recursively_apply(gather_one, tensor, error_on_other_type=True)


def gather_object(obj: Any) -> list[Any]:
    """Gather a picklable list from every process into one flat list, in rank order.

    Raises:
        TypeError: If ``obj`` is not a list or tuple (each process contributes its items).

    """
    if not isinstance(obj, (list, tuple)):
        raise TypeError(f"gather_object expects a list or tuple of objects, got {type(obj).__name__}; wrap it: [obj].")
    if _world_size() == 1:
        return list(obj)
    parts: list[Any] = [None] * _world_size()
    dist.all_gather_object(parts, list(obj))
    return [item for part in parts for item in part]


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Overwrite ``tensor`` (in place, and return it) with the values of process ``from_process``.

    With one process the data comes back as it is, whatever it holds (as in Accelerate).
    """
    if _world_size() == 1:
        return tensor

    def broadcast_one(value: Tensor) -> Tensor:
        if _world_size() > 1:
            dist.broadcast(value, src=from_process)
        return value

    _verify_shapes("broadcast", tensor)
    return recursively_apply(broadcast_one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` (in place, and return it) with those of process ``from_process``."""
    if _world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce ``tensor`` over all processes: ``"mean"`` (the default, as in ``accelerate.utils``), ``"sum"``, ``"max"``.

    The result is a new tensor multiplied by ``scale`` (Accelerate applies ``scale`` only on XLA).

    Raises:
        ValueError: For another ``reduction``.

    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"Unknown reduction {reduction!r}; use one of {', '.join(_REDUCTIONS)}.")

    def reduce_one(value: Tensor) -> Tensor:
        result = value.clone()
        if _world_size() > 1:
            dist.all_reduce(result, _REDUCTIONS[reduction])
            if reduction == "mean":
                result /= _world_size()
        return result * scale if scale != 1.0 else result

    _verify_shapes("reduce", tensor)
    return recursively_apply(reduce_one, tensor, error_on_other_type=True)


class CannotPadNestedTensorWarning(UserWarning):
    """A nested (jagged) tensor was given to :func:`pad_across_processes`, which returns it unpadded."""


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad ``tensor`` along ``dim`` with ``pad_index`` to the largest size any process has, so it can be gathered.

    A nested tensor has no single size to pad to: it is returned as it is, with a
    :class:`CannotPadNestedTensorWarning`. A ``dim`` outside the tensor's dimensions leaves it unchanged.

    Args:
        tensor: The data to pad.
        dim: The dimension to pad.
        pad_index: The padding value.
        pad_first: Pad at the start instead of the end.

    """

    def pad_one(value: Tensor) -> Tensor:
        if value.is_nested:
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor (its rows have different sizes); it is returned "
                "unpadded: pad its rows into a regular tensor first",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return value
        if _world_size() == 1 or dim >= value.ndim or dim < -value.ndim:
            return value
        size = torch.tensor(value.shape, device=value.device)[None]
        largest = int(gather(size)[:, dim].max())
        if largest == value.shape[dim]:
            return value
        shape = list(value.shape)
        shape[dim] = largest
        padded = value.new_full(shape, pad_index)
        start = largest - value.shape[dim] if pad_first else 0
        index = [slice(None)] * value.ndim
        index[dim] = slice(start, start + value.shape[dim])
        padded[tuple(index)] = value
        return padded

    return recursively_apply(pad_one, tensor, error_on_other_type=True)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad every tensor in ``tensor`` with zero rows to a multiple of ``num_processes``, so each process gets a share.

    ``batch_size`` is the size of ``dim`` (e.g. from :func:`find_batch_size`); it grows to the smallest multiple of
    ``num_processes`` that holds it (4 rows on 3 processes become 6, 1 row on 6 processes becomes 6). Accelerate
    1.15 pads divisible sizes too (2 rows on 2 processes become 3) and some others past a multiple (7 on 4 become 10);
    here a divisible batch is returned as it is.

    Raises:
        ValueError: If ``batch_size`` is negative or ``num_processes`` below 1.

    """
    if batch_size < 0 or num_processes < 1:
        raise ValueError(
            f"pad_input_tensors needs batch_size >= 0 and num_processes >= 1, got {batch_size} and {num_processes}"
        )
    target = -(-batch_size // num_processes) * num_processes

    def pad_one(value: Tensor) -> Tensor:
        if target == batch_size:
            return value
        shape = list(value.shape)
        shape[dim] = target
        padded = value.new_zeros(shape)
        index = [slice(None)] * value.ndim
        index[dim] = slice(0, value.shape[dim])
        padded[tuple(index)] = value
        return padded

    return recursively_apply(pad_one, tensor, error_on_other_type=True)


def copy_tensor_to_devices(tensor: Tensor | None = None) -> Tensor:
    """Give every process the tensor that one process holds, without the others knowing its shape or dtype.

    Exactly one process passes the tensor; the others pass ``None``. Its shape and dtype are broadcast first, then its
    values (a copy, on this process's device, on every process).

    Raises:
        ValueError: If no process, or more than one, passes a tensor.

    """
    from lightning_accel.state import PartialState

    device = PartialState().device
    if _world_size() == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices got None on the only process; pass the tensor to copy")
        return tensor.clone().to(device)
    holders: list[Any] = [None] * _world_size()
    description = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    dist.all_gather_object(holders, description)
    sources = [rank for rank, held in enumerate(holders) if held is not None]
    if len(sources) != 1:
        raise ValueError(
            f"copy_tensor_to_devices needs the tensor on exactly one process and None on the others; processes "
            f"{sources} passed one"
        )
    shape, dtype = holders[sources[0]]
    result = tensor.clone().to(device) if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(result, src=sources[0])
    return result


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (nested lists, tuples and mappings), ``None`` without one."""
    if isinstance(data, Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
    return None


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally structured nested tensors along ``dim`` (a single batch is returned as it is).

    Raises:
        TypeError: If the items are not tensors (or nested lists, tuples and dicts of them).

    """
    first = data[0]
    if len(data) == 1 and not isinstance(first, (list, tuple, Mapping, Tensor)):
        return first  # a single batch comes back as it is, tensor or not (as in Accelerate)
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [concatenate([d[i] for d in data], dim=dim) for i in range(len(first))])
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})  # type: ignore[call-arg]
    if not isinstance(first, Tensor):
        raise TypeError(f"concatenate works on (nested) tensors only, got {type(first).__name__}.")
    return torch.cat(list(data), dim=dim)


def slice_tensors(
    data: Any, tensor_slice: slice | int, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Index every tensor in ``data`` with ``tensor_slice``.

    ``process_index`` and ``num_processes`` are accepted for Accelerate's signature and unused, as there.
    """
    del process_index, num_processes
    return recursively_apply(lambda t: t[tensor_slice], data)


def convert_to_fp32(tensor: Any) -> Any:
    """Cast every fp16/bf16 tensor in ``tensor`` to fp32 (other tensors and objects are kept)."""

    def is_half(value: Any) -> bool:
        return isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16)

    return recursively_apply(lambda t: t.float(), tensor, test_type=is_half)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its fp16/bf16 outputs come back as fp32."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def listify(data: Any) -> Any:
    """Replace every tensor in ``data`` by Python numbers (``tensor.tolist()``; bf16 goes through fp32)."""

    def to_list(value: Tensor) -> Any:
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).tolist()

    return recursively_apply(to_list, data)


def find_batch_size(data: Any) -> int:
    """The size of dim 0 of the first tensor found in ``data``.

    Raises:
        TypeError: If the first leaf is not a tensor.
        ValueError: If ``data`` is an empty container.

    """
    if isinstance(data, (list, tuple, Mapping)):
        if len(data) == 0:
            raise ValueError("Cannot find the batch size of an empty container.")
        return find_batch_size(next(iter(data.values())) if isinstance(data, Mapping) else data[0])
    if not isinstance(data, Tensor):
        raise TypeError(f"Can only find the batch size of tensors, got {type(data).__name__}.")
    return int(data.shape[0])
