"""Accelerate's tensor operations: collectives, and the helpers that recurse through nested lists, tuples and dicts.

Collectives use the default ``torch.distributed`` process group (created by the ``Accelerator``'s strategy) and run
under its timeout; without a process group, or with one process, they return their input (or a copy). The nested-data
helpers live in :mod:`lightning_accel.utils.nested` and are importable from here, Accelerate's path.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_accel.utils.nested import (
    ConvertOutputsToFp32,
    TensorInformation,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    is_torch_xpu_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)

__all__ = [
    "TENSOR_INT_TO_DTYPE",
    "TENSOR_TYPE_TO_INT",
    "CannotPadNestedTensorWarning",
    "ConvertOutputsToFp32",
    "DistributedOperationException",
    "GatheredParameters",
    "TensorInformation",
    "broadcast",
    "broadcast_object_list",
    "chained_operation",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "gather_tensor_shape",
    "get_data_structure",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "is_torch_xpu_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "verify_operation",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_REDUCTIONS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# Accelerate's codes for the dtypes ``gather_tensor_shape`` sends along with a shape.
TENSOR_TYPE_TO_INT = {
    torch.float: 1,
    torch.double: 2,
    torch.half: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
TENSOR_INT_TO_DTYPE = {code: dtype for dtype, code in TENSOR_TYPE_TO_INT.items()}


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


def gather_object(object: Any) -> list[Any]:  # Accelerate names it object
    """Gather a picklable list from every process into one flat list, in rank order.

    Raises:
        TypeError: If ``object`` is not a list or tuple (each process contributes its items).

    """
    if not isinstance(object, (list, tuple)):
        raise TypeError(
            f"gather_object expects a list or tuple of objects, got {type(object).__name__}; wrap it: [obj]."
        )
    if _world_size() == 1:
        return list(object)
    parts: list[Any] = [None] * _world_size()
    dist.all_gather_object(parts, list(object))
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


def verify_operation(function: _F) -> _F:
    """Decorate a collective so that, in debug mode, every process's input shapes are compared first.

    As Accelerate's: with ``ACCELERATE_DEBUG_MODE`` (``PartialState().debug``) and several processes, the ``tensor``
    argument (or the first one) must be on the state's device type and have the same shapes everywhere, or
    :class:`DistributedOperationException` lists them; otherwise the collective runs as it is.
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from lightning_accel.state import PartialState

        if _world_size() > 1 and getattr(PartialState(), "debug", False):
            operation = f"{function.__module__}.{function.__name__}"
            tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
            device = find_device(tensor)
            expected = PartialState().device.type
            if device is not None and device.type != expected:
                raise DistributedOperationException(
                    f"One or more of the tensors passed to {operation} were not on the {device.type} while the "
                    f"Accelerator is configured for {expected}: move them to {expected} before calling {operation}."
                )
            _verify_shapes(operation, tensor)
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def chained_operation(function: _F) -> _F:
    """Decorate an operation built on collectives: re-raise a :class:`DistributedOperationException` naming it.

    Raises:
        DistributedOperationException: Chained to the one the inner collective raised.

    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as error:
            operation = f"{function.__module__}.{function.__name__}"
            raise DistributedOperationException(
                f"Error found while calling `{operation}`. Please see the earlier error for more details."
            ) from error

    return wrapper  # type: ignore[return-value]


def gather_tensor_shape(tensor: Tensor | None) -> tuple[Tensor, int]:
    """The shape and dtype code of the tensor one process holds (the others pass ``None``), on every process.

    As Accelerate's: the holder writes its shape and :data:`TENSOR_TYPE_TO_INT` code into a buffer of ``2**20`` ints
    that is summed over the processes. Returns the shape as a 1-d int tensor (on the state's device; a 0-d tensor
    has an empty one) and the dtype code.
    """
    from lightning_accel.state import PartialState

    buffer = torch.zeros(2**20, dtype=torch.int, device=PartialState().device)
    if tensor is not None:
        shape = list(tensor.shape)
        buffer[: len(shape) + 1] = torch.tensor([*shape, TENSOR_TYPE_TO_INT[tensor.dtype]], dtype=torch.int)
    buffer = reduce(buffer, reduction="sum")
    buffer = buffer[buffer.nonzero()]
    return buffer[:-1], int(buffer[-1:][0])


@contextmanager
def GatheredParameters(  # Accelerate names it so
    params: Iterable[torch.Tensor] | torch.Tensor,
    modifier_rank: int | None = None,
    fwd_module: torch.nn.Module | None = None,
    enabled: bool = True,
) -> Generator[None, None, None]:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters`` under ZeRO-3, a context that does nothing otherwise.

    Inside it, ZeRO-3 partitioned ``params`` are whole on every process (``modifier_rank``'s changes are kept when it
    ends). Without DeepSpeed, or with a DeepSpeed plugin whose ZeRO-3 ``zero.Init`` is off, parameters are whole
    already, so nothing happens (Accelerate's rule).

    Args:
        params: The parameters to gather.
        modifier_rank: The process whose in-place changes are broadcast when the context ends (``None``: none).
        fwd_module: Passed on to DeepSpeed (registers external parameters of that module).
        enabled: Passed on to DeepSpeed (``False`` turns the gathering off).

    """
    from lightning_accel.enums import DistributedType
    from lightning_accel.state import AcceleratorState

    state = AcceleratorState()
    plugin = getattr(state, "deepspeed_plugin", None)
    context: Any = nullcontext()
    if state.distributed_type == DistributedType.DEEPSPEED and (plugin is None or plugin.is_zero3_init_enabled()):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(
            params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled
        )
    with context:
        yield
