"""Accelerate's tensor-level model helpers: move one parameter or buffer, list a module's tensors, find tied weights.

Devices are what Accelerate's device maps hold: ``"cpu"``, ``"meta"``, an ``int`` (an index on the machine's
accelerator, whatever torch reports it to be: CUDA, XPU, MPS, NPU, ...), or any device string or ``torch.device``.
``"disk"`` is a placement, never a device a tensor can be on, so it is refused here.
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import torch
from torch import nn

from lightning_accel.utils.memory import DeviceLike, clear_device_cache, resolve_device
from lightning_accel.utils.other import id_tensor_storage

__all__ = [
    "DeviceLike",
    "TiedParamsMap",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "find_tied_parameters",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "named_module_tensors",
    "resolve_device",
    "retie_parameters",
    "set_module_tensor_to_device",
]

logger = logging.getLogger(__name__)

# Original data pointer of a tied weight -> the copy already placed on each device (shared instead of re-copied).
TiedParamsMap: TypeAlias = dict[int, dict[torch.device, torch.Tensor]]

# Parameter classes whose device moves quantize the data; they need the quantization support of issue 15.
_QUANTIZED_PARAMETER_CLASSES = ("Int8Params", "FP4Params", "Params4bit")


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """Whether two devices are the same, an accelerator without an index counting as index 0 (``cuda:0``)."""
    if first_device.type != second_device.type:
        return False
    if first_device.type == "cpu":
        return True
    return (first_device.index or 0) == (second_device.index or 0)


def _owner_and_name(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``tensor_name`` (a dotted path) and the tensor's name inside it."""
    *path, name = tensor_name.split(".")
    owner = module
    for part in path:
        child = getattr(owner, part, None)
        if child is None:
            raise ValueError(f"{owner} has no attribute {part}.")
        owner = child
    return owner, name


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return str(dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


def _shared_tied_copy(
    tied_params_map: TiedParamsMap | None, key: torch.device, *tensors: torch.Tensor | None
) -> torch.Tensor | None:
    """The copy of a tied weight already placed on ``key``, looked up by the first of ``tensors`` that is tied."""
    if tied_params_map is None:
        return None
    for tensor in tensors:
        if tensor is not None and key in tied_params_map.get(tensor.data_ptr(), {}):
            return tied_params_map[tensor.data_ptr()][key]
    return None


def _rebuild_parameter(old: nn.Parameter, data: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A parameter of ``old``'s class holding ``data``, keeping ``requires_grad`` and transformers' init marker."""
    param_cls = type(old)
    hf_initialized = old.__dict__.get("_is_hf_initialized")
    new: torch.Tensor
    if param_cls.__name__ in _QUANTIZED_PARAMETER_CLASSES:
        # bitsandbytes quantizes unquantized data (kept on the CPU) as it moves off it; its settings are attributes.
        if isinstance(data, param_cls):  # bitsandbytes' own ``.to`` made it
            return data
        attributes = {key: value for key, value in old.__dict__.items() if key != "_is_hf_initialized"}
        if param_cls.__name__ == "Int8Params" and data.dtype == torch.int8:
            attributes["CB"] = data  # already quantized: the int8 data is the weight (its SCB is set by the caller)
        new = param_cls(data, requires_grad=old.requires_grad, **attributes)
        if device.type != "meta":
            new = new.to(device)
    elif "torchao" in getattr(param_cls, "__module__", "") or param_cls.__name__ == "AffineQuantizedTensor":
        new = data.to(device)
    elif param_cls.__name__ in ("QTensor", "QBitsTensor"):
        new = nn.Parameter(data, requires_grad=old.requires_grad).to(device)
    else:
        new = param_cls(data, requires_grad=old.requires_grad)
    if hf_initialized is not None:
        new._is_hf_initialized = hf_initialized  # type: ignore[attr-defined]
    return new


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: DeviceLike,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: TiedParamsMap | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put one parameter or buffer of ``module`` on ``device``, optionally with new data.

    ``param.to(device)`` returns a new tensor that the module does not hold; this replaces the module's entry
    instead, keeping the parameter's class and ``requires_grad``.

    Args:
        module: The module (or an ancestor of it) holding the tensor.
        tensor_name: The tensor's name, dotted from ``module`` (``"linear1.weight"``).
        device: Where to put it.
        value: New data (needed to leave the meta device); cast to the current dtype unless ``dtype`` is given.
        dtype: Cast floating-point data to this dtype (integer and bool tensors keep theirs).
        fp16_statistics: 8-bit serialization statistics, set as the parameter's ``SCB``.
        tied_params_map: Shared copies of tied weights per device; a weight already placed on ``device`` is reused
            instead of copied, and a newly placed tied weight is recorded.
        non_blocking: Asynchronous copies where the devices allow it.
        clear_cache: Empty the accelerator cache after placing the tensor on an accelerator.

    Raises:
        ValueError: For an unknown tensor name, a shape mismatch, or a meta tensor moved without ``value``.

    """
    owner, name = _owner_and_name(module, tensor_name)
    old_value = _registered_tensor(owner, name, tensor_name)
    target = resolve_device(device)
    shared = _shared_tied_copy(tied_params_map, target, value, old_value)
    if shared is not None:
        owner._parameters[name] = shared  # type: ignore[assignment]
        return
    if old_value.device.type == "meta" and target.type != "meta" and value is None:
        raise ValueError(f"{tensor_name} is on the meta device, we need a `value` to put in on {device}.")

    value_ptr = value.data_ptr() if value is not None else None
    cast_to: torch.dtype | None = getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype
    param_cls: type[Any] = type(owner._parameters.get(name))
    if value is not None:
        value = _cast_new_value(value, old_value, cast_to, param_cls, tensor_name, non_blocking)
    with torch.no_grad():
        _place(owner, name, old_value, value, _PlaceOptions(target, cast_to, param_cls, non_blocking, fp16_statistics))
    if clear_cache and target.type not in ("cpu", "meta"):
        clear_device_cache()
    if tied_params_map is not None:
        _record_tied_copy(tied_params_map, getattr(owner, name), target, (old_value.data_ptr(), value_ptr))


def _registered_tensor(owner: nn.Module, name: str, tensor_name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` of ``owner``; refused when unknown or registered as None."""
    if name not in owner._parameters and name not in owner._buffers:
        raise ValueError(f"{owner} does not have a parameter or a buffer named {name}.")
    old_value = getattr(owner, name)
    if old_value is None:
        raise ValueError(f"{tensor_name!r} is registered as None on {owner}; there is no tensor to move.")
    return cast(torch.Tensor, old_value)


def _cast_new_value(
    value: torch.Tensor,
    old_value: torch.Tensor,
    dtype: torch.dtype | None,
    param_cls: type[Any],
    tensor_name: str,
    non_blocking: bool,
) -> torch.Tensor:
    """``value`` checked against the old shape and cast to ``dtype`` (or the old dtype); integer data keeps its own."""
    if old_value.shape != value.shape and param_cls.__name__ != "Params4bit":
        raise ValueError(
            f'Trying to set a tensor of shape {value.shape} in "{tensor_name}" (which has shape '
            f"{old_value.shape}), this looks incorrect."
        )
    if dtype is None:
        return value.to(old_value.dtype, non_blocking=non_blocking)
    if not _is_integer_dtype(value.dtype):
        return value.to(dtype, non_blocking=non_blocking)
    return value


@dataclass(frozen=True)
class _PlaceOptions:
    target: torch.device
    dtype: torch.dtype | None
    param_cls: type[Any]
    non_blocking: bool
    fp16_statistics: torch.Tensor | None


def _moved_value(
    owner: nn.Module, name: str, old_value: torch.Tensor, value: torch.Tensor | None, options: _PlaceOptions
) -> torch.Tensor:
    """The tensor to store: the old one moved (cast on the meta device), or the new data on its way to the target."""
    target = options.target
    if value is None:
        new_value = old_value.to(target, non_blocking=options.non_blocking)
        if options.dtype is not None and target.type == "meta":
            if not _is_integer_dtype(old_value.dtype):
                new_value = new_value.to(options.dtype)
            if name not in owner._buffers:
                owner._parameters[name] = options.param_cls(new_value, requires_grad=old_value.requires_grad)
        return new_value
    if options.param_cls.__name__ in _QUANTIZED_PARAMETER_CLASSES and target.type != "meta":
        return value.to("cpu")  # quantized on its way to ``target`` (see _rebuild_parameter)
    return value.to(target, non_blocking=options.non_blocking)


def _place(
    owner: nn.Module, name: str, old_value: torch.Tensor, value: torch.Tensor | None, options: _PlaceOptions
) -> None:
    """Store the moved tensor in ``owner``: a buffer as it is, a parameter rebuilt with its class."""
    new_value = _moved_value(owner, name, old_value, value, options)
    target = options.target
    if name in owner._buffers:
        owner._buffers[name] = new_value
    elif value is not None or not check_device_same(target, owner._parameters[name].device):  # type: ignore[union-attr]
        old_param = owner._parameters[name]
        assert old_param is not None
        owner._parameters[name] = _rebuild_parameter(old_param, new_value, target)  # type: ignore[assignment]
        if options.fp16_statistics is not None:
            owner._parameters[name].SCB = options.fp16_statistics.to(target)  # type: ignore[union-attr]


def _record_tied_copy(
    tied_params_map: TiedParamsMap, placed: torch.Tensor, target: torch.device, pointers: tuple[int | None, ...]
) -> None:
    """Record ``placed`` as the copy on ``target`` of the first tied weight (by data pointer) not yet placed there."""
    for ptr in pointers:
        if ptr is not None and ptr in tied_params_map and target not in tied_params_map[ptr]:
            tied_params_map[ptr][target] = placed
            break


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """The names of ``module``'s non-persistent buffers (those left out of its state dict).

    Args:
        module: The module to inspect.
        recurse: Include the submodules' non-persistent buffers.
        fqns: Name them by their dotted path from ``module`` rather than by their name in their own module.

    """
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, submodule in module.named_modules():
            for buffer in submodule._non_persistent_buffers_set:
                names.add(f"{prefix}.{buffer}" if fqns and prefix else buffer)
    return names


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s parameters, then its buffers, by name.

    Args:
        module: The module.
        include_buffers: Also yield the buffers.
        recurse: Include the submodules' tensors (named by their dotted path), not only the direct ones.
        remove_non_persistent: Leave out non-persistent buffers.

    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
    for name, buffer in module.named_buffers(recurse=recurse):
        if name not in skipped:
            yield name, buffer


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Groups of parameter names that are the same parameter, each group sorted.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> model[1].weight = model[0].weight
        >>> find_tied_parameters(model)
        [['0.weight', '1.weight']]

    """
    del kwargs  # Accelerate's signature takes keyword arguments it no longer uses.
    names_by_parameter: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_parameter[id(param)].append(name)
    return [sorted(names) for names in names_by_parameter.values() if len(names) > 1]


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, attr = _owner_and_name(model, name)
    tensor: torch.Tensor = getattr(owner, attr)
    return tensor


def retie_parameters(model: nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make each group of names the same parameter again (after hooks replaced some of them).

    The group takes its first member that is not on the meta device, or its first member when all are on meta
    (so the tie survives offloading: Accelerate leaves such a group untied).

    Args:
        model: The model.
        tied_params: Groups of parameter names, as :func:`find_tied_parameters` returns them.

    """
    for group in tied_params:
        members = [_get_tensor(model, name) for name in group]
        kept = next((param for param in members if param.device.type != "meta"), members[0])
        for name in group:
            owner, attr = _owner_and_name(model, name)
            setattr(owner, attr, kept)


def _device_of(name: str, device_map: Mapping[str, DeviceLike]) -> DeviceLike:
    while name not in device_map:
        if name == "":
            raise ValueError("The `device_map` does not contain the module of every tied parameter.")
        name = name.rpartition(".")[0]
    return device_map[name]


def check_tied_parameters_on_same_device(
    tied_params: Sequence[Sequence[str]], device_map: Mapping[str, DeviceLike]
) -> None:
    """Warn about tied parameters that ``device_map`` puts on different devices.

    Args:
        tied_params: Groups of tied parameter names.
        device_map: Module names to devices.

    """
    for group in tied_params:
        devices = {name: _device_of(name, device_map) for name in group}
        if len(set(devices.values())) > 1:
            logger.warning(
                f"Tied parameters are on different devices: {devices}. "
                "Please modify your custom device map or set `device_map='auto'`. "
            )


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model's configuration says some of its weights should be tied."""
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    text_config = (
        config.get_text_config(decoder=True) if config is not None and hasattr(config, "get_text_config") else config
    )
    tied_embeddings = bool(
        text_config is not None and getattr(text_config, "tie_word_embeddings", False) and model.get_output_embeddings()  # type: ignore[operator]
    )
    tied_encoder_decoder = bool(
        getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False)
    )
    tied_module = any(hasattr(submodule, "_tie_weights") for submodule in model.modules())
    return tied_embeddings or tied_encoder_decoder or tied_module
