"""Helpers that recurse through nested lists, tuples (namedtuples too) and mappings of tensors.

Accelerate's ``accelerate.utils.operations`` names for the data-structure side: applying a function to every leaf,
moving to a device, shapes and :class:`TensorInformation`, batch sizes, fp32 conversion. They are re-exported from
:mod:`lightning_accel.utils.operations` (and :mod:`lightning_accel.utils`), the paths to import them from.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ConvertOutputsToFp32",
    "TensorInformation",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "find_batch_size",
    "find_device",
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
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
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

    Args:
        tensor: The data to move.
        device: Target device.
        non_blocking: Asynchronous copies (with pinned memory).
        skip_keys: Mapping keys whose values are left where they are.

    """
    if isinstance(tensor, Tensor):
        return tensor.to(device, non_blocking=non_blocking)
    if skip_keys is None and type(tensor) in (list, tuple):  # a loader's usual batch, moved every step
        return type(tensor)(
            [
                t.to(device, non_blocking=non_blocking)
                if isinstance(t, Tensor)
                else send_to_device(t, device, non_blocking)
                for t in tensor
            ]
        )
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
