"""Accelerate's tensor operations: collectives, and the helpers that recurse through nested lists, tuples and dicts.

Collectives use the default ``torch.distributed`` process group (created by the ``Accelerator``'s strategy) and run
under its timeout; without a process group, or with one process, they return their input (or a copy). The nested-data
helpers (recursing through lists, tuples, namedtuples and mappings of tensors) come first.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

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


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor``."""
    return isinstance(tensor, Tensor)


def is_torch_xpu_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor on an Intel XPU."""
    return isinstance(tensor, Tensor) and tensor.device.type == "xpu"


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor, to allocate one like it (see :func:`initialize_tensors`)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is an instance of a ``collections.namedtuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def honor_type(obj: Sequence[Any], generator: Iterable[Any]) -> Any:
    """A sequence of ``obj``'s type (list, tuple, namedtuple, ...) holding the items of ``generator``.

    Namedtuples are rebuilt field by field (``type(obj)(*items)``), other sequences from the items
    (``type(obj)(items)``).
    """
    cls: Any = type(obj)
    return cls(*list(generator)) if is_namedtuple(obj) else cls(generator)


def _rebuild(container: Sequence[Any], items: list[Any]) -> Any:
    return honor_type(container, items)


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

    What is on ``device`` already comes back as it is: a tensor, and a list or tuple of such tensors (as
    ``Tensor.to`` returns the tensor itself); other containers are rebuilt.

    Args:
        tensor: The data to move.
        device: Target device.
        non_blocking: Asynchronous copies (with pinned memory).
        skip_keys: Mapping keys whose values are left where they are.

    """
    if isinstance(tensor, Tensor):
        return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)
    kind = type(tensor)
    if skip_keys is None and (kind is list or kind is tuple):  # a loader's usual batch, moved every step
        for t in tensor:
            if not (isinstance(t, Tensor) and t.device == device):
                break
        else:  # tensors all on the device already: the batch itself, as Tensor.to returns itself
            return tensor
        items = [send_to_device(t, device, non_blocking) for t in tensor]
        return items if kind is list else tuple(items)
    if skip_keys is None and kind is dict:
        return {
            key: value
            if isinstance(value, Tensor) and value.device == device
            else send_to_device(value, device, non_blocking)
            for key, value in tensor.items()
        }
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


def get_data_structure(data: Any) -> Any:
    """``data`` with every tensor replaced by its :class:`TensorInformation` (shape and dtype)."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    """``data`` with every tensor replaced by its shape, as a list of ints."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """``data_structure`` with every :class:`TensorInformation` replaced by an uninitialised CPU tensor like it."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure, test_type=is_tensor_information
    )


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


class ConvertOutputsToFp32:
    """A forward function whose fp16/bf16 outputs come back as fp32 (Accelerate's wrapper; it refuses pickling).

    Args:
        model_forward: The function whose outputs to convert.

    """

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function and convert its outputs."""
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> None:
        """Refuse, as Accelerate does: unwrap the model first.

        Raises:
            pickle.PicklingError: Always.

        """
        raise pickle.PicklingError(
            "Cannot pickle a prepared model with automatic mixed precision, please unwrap the model with "
            "`Accelerator.unwrap_model(model)` before pickling it."
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its fp16/bf16 outputs come back as fp32.

    The result's ``__wrapped__`` leads back to ``model_forward``, so
    ``extract_model_from_parallel(keep_fp32_wrapper=False)`` can remove it.
    """
    wrapper = ConvertOutputsToFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapper(*args, **kwargs)

    forward.__wrapped__ = wrapper  # type: ignore[attr-defined]
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


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or ``None`` where it raises (no tensor, an empty container)."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


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


def _process_rank() -> int:
    """The rank of this process in the default process group (``0`` without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_main_process() -> bool:
    """Whether this is process 0 (or the only process), without creating a ``PartialState``."""
    return _process_rank() == 0


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
