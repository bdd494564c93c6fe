"""Device alignment: :class:`AlignDevicesHook` and the functions that attach it as a device map asks.

The hook moves a module's inputs (and weights) to its execution device before ``forward``; with ``offload=True`` the
weights live in a ``weights_map`` (CPU memory or memory-mapped files) and are put on the device only for the call,
the module holding meta tensors in between.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_accel.hooks.base import ModelHook, _eager, add_hook_to_module
from lightning_accel.utils.modeling.tensors import (
    DeviceLike,
    TiedParamsMap,
    get_non_persistent_buffers,
    named_module_tensors,
    resolve_device,
    set_module_tensor_to_device,
)
from lightning_accel.utils.offload import PrefixedDataset
from lightning_accel.utils.operations import find_device, send_to_device

__all__ = [
    "AlignDevicesHook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
]


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    return functools.reduce(getattr, name.split("."), module)  # type: ignore[return-value]


# A hook is itself, not its settings: compared and hashed by identity (eq=False), as a plain class.
@dataclass(eq=False, repr=False)
class AlignDevicesHook(ModelHook):
    """Put a module's inputs and weights on one device for ``forward``, optionally keeping the weights offloaded.

    Args:
        execution_device: Where inputs and weights go before ``forward`` (``None``: left where they are).
        offload: Keep the weights in ``weights_map`` and on the meta device outside ``forward``.
        io_same_device: Send the output back to the device of the first input tensor.
        weights_map: The offloaded weights by name (relative to the module); built from the module on the CPU when
            ``None``.
        offload_buffers: Offload the buffers too (otherwise they stay on the execution device).
        place_submodules: Handle the submodules' tensors too, not only the module's own.
        skip_keys: Keyword arguments (and output keys) left where they are.
        tied_params_map: Shared per-device copies of tied weights (see :func:`set_module_tensor_to_device`), so a
            weight tied across modules is placed once per device.

    """

    execution_device: DeviceLike | None = None
    offload: bool = False
    io_same_device: bool = False
    weights_map: Mapping[str, torch.Tensor] | None = None
    offload_buffers: bool = False
    place_submodules: bool = False
    skip_keys: str | list[str] | None = None
    tied_params_map: TiedParamsMap | None = None
    input_device: torch.device | None = field(default=None, init=False)
    original_devices: dict[str, torch.device] = field(default_factory=dict, init=False)
    tied_params_names: set[str] = field(default_factory=set, init=False)
    tied_pointers_to_remove: set[tuple[int, torch.device]] = field(default_factory=set, init=False)

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded_tensors(self, module: nn.Module) -> list[str]:
        tensors = named_module_tensors(
            module, include_buffers=self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True
        )
        return [name for name, _ in tensors]

    def _place(self, module: nn.Module, names: list[str]) -> None:
        assert self.execution_device is not None
        for name in names:
            set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)

    @override
    def init_hook(self, module: nn.Module) -> nn.Module:
        # Meta tensors all have data pointer 0, so ties cannot be told apart there.
        if self.execution_device is not None and resolve_device(self.execution_device).type == "meta":
            self.tied_params_map = None
        if not self.offload:
            if self.execution_device is not None:
                self._place(module, [name for name, _ in named_module_tensors(module, recurse=self.place_submodules)])
            return module

        tensors = named_module_tensors(module, recurse=self.place_submodules)
        self.original_devices = {name: tensor.device for name, tensor in tensors}
        if self.weights_map is None:
            own = named_module_tensors(module, include_buffers=self.offload_buffers, recurse=self.place_submodules)
            self.weights_map = {name: tensor.to("cpu") for name, tensor in own}
        for name in self._offloaded_tensors(module):
            # A disk-offloaded tied weight is re-read on each call (no stable pointer): remember it by name.
            if self.tied_params_map is not None and _get_tensor(module, name).data_ptr() in self.tied_params_map:
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is not None:
            if self.offload_buffers:
                self._place(
                    module, sorted(get_non_persistent_buffers(module, recurse=self.place_submodules, fqns=True))
                )
            else:
                self._place(module, [name for name, _ in module.named_buffers(recurse=self.place_submodules)])
        return module

    def _statistics_of(self, name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """The ``SCB`` entry stored beside an int8 weight (8-bit serialization), to restore with it."""
        if value is None or value.dtype != torch.int8 or "weight" not in name or self.weights_map is None:
            return None
        return self.weights_map.get(name.replace("weight", "SCB"))

    @override
    @_eager
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self._load_offloaded(module)
        if self.execution_device is None:
            return args, kwargs
        device = resolve_device(self.execution_device)
        return send_to_device(args, device), send_to_device(kwargs, device, skip_keys=self.skip_keys)

    def _load_offloaded(self, module: nn.Module) -> None:
        assert self.weights_map is not None and self.execution_device is not None
        device = resolve_device(self.execution_device)
        self.tied_pointers_to_remove = set()
        for name in self._offloaded_tensors(module):
            value = self.weights_map[name]
            ties = self.tied_params_map
            if ties is not None:
                pointer = value.data_ptr()
                if name in self.tied_params_names and pointer not in ties:
                    ties[pointer] = {}
                # Forget this call's device copy of a tied weight afterwards, so its memory can be freed.
                if pointer in ties and device not in ties[pointer]:
                    self.tied_pointers_to_remove.add((pointer, device))
            set_module_tensor_to_device(
                module,
                name,
                self.execution_device,
                value=value,
                fp16_statistics=self._statistics_of(name, value),
                tied_params_map=ties,
            )

    @override
    @_eager
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded_tensors(module):
                set_module_tensor_to_device(module, name, "meta")
            for pointer, device in self.tied_pointers_to_remove:
                if self.tied_params_map is not None:
                    self.tied_params_map[pointer].pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    @override
    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            for name, device in self.original_devices.items():
                if device.type == "meta":
                    continue
                value = self.weights_map.get(name) if self.weights_map is not None else None
                statistics = self._statistics_of(name, value)
                set_module_tensor_to_device(module, name, device, value=value, fp16_statistics=statistics)
        return module


def _preloads(module: nn.Module, preload_module_classes: list[str] | None) -> bool:
    """Whether ``module``'s class is one of ``preload_module_classes`` (it loads its submodules' weights itself)."""
    return preload_module_classes is not None and type(module).__name__ in preload_module_classes


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: DeviceLike | None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Give every submodule that has tensors and no hook an :class:`AlignDevicesHook` to ``execution_device``.

    Args:
        module: The root module.
        execution_device: Where inputs go before each ``forward``.
        skip_keys: Keyword arguments left where they are.
        preload_module_classes: Class names whose submodules are not descended into (their weights are loaded with
            them).
        tied_params_map: Shared per-device copies of tied weights.

    """
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        hook = AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        add_hook_to_module(module, hook)
    if _preloads(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


@dataclass(frozen=True)
class _Walk:
    """What an ``attach_align_device_hook*`` walk hands down to every submodule unchanged."""

    weights_map: Mapping[str, torch.Tensor] | None
    offload_buffers: bool
    skip_keys: str | list[str] | None
    preload_module_classes: list[str] | None
    tied_params_map: TiedParamsMap | None

    def preloads(self, module: nn.Module) -> bool:
        """Whether ``module``'s class loads its submodules' weights itself (see :func:`_preloads`)."""
        return _preloads(module, self.preload_module_classes)


def _named_children(module: nn.Module, module_name: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s children with their names in the model (``module`` being ``module_name``)."""
    for child_name, child in module.named_children():
        yield (f"{module_name}.{child_name}" if module_name else child_name), child


def attach_align_device_hook(
    module: nn.Module,
    execution_device: DeviceLike | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach an :class:`AlignDevicesHook` (chained after any existing hook) to each submodule with direct tensors.

    Args:
        module: The root module.
        execution_device: Where inputs and weights go before each ``forward``.
        offload: Offload the weights between calls.
        weights_map: The whole model's offloaded weights, by name from the root (each hook sees its own prefix).
        offload_buffers: Offload the buffers too.
        module_name: ``module``'s name in the model (the prefix into ``weights_map``).
        skip_keys: Keyword arguments left where they are.
        preload_module_classes: Class names whose instances load all their submodules' weights at the start of their
            own ``forward`` (for modules that use a child's weights without calling the child).
        tied_params_map: Shared per-device copies of tied weights.

    """
    walk = _Walk(weights_map, offload_buffers, skip_keys, preload_module_classes, tied_params_map)
    _attach_aligned(module, execution_device, offload, module_name, walk)


def _attach_aligned(
    module: nn.Module, execution_device: DeviceLike | None, offload: bool, module_name: str, walk: _Walk
) -> None:
    preload = offload and walk.preloads(module)
    if any(True for _ in named_module_tensors(module)) or preload:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=PrefixedDataset(walk.weights_map, prefix) if walk.weights_map is not None else None,
            offload_buffers=walk.offload_buffers,
            place_submodules=preload,
            skip_keys=walk.skip_keys,
            tied_params_map=walk.tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if preload:
        return
    for child_name, child in _named_children(module, module_name):
        _attach_aligned(child, execution_device, offload, child_name, walk)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: DeviceLike | Mapping[str, DeviceLike | None] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Attach the hooks a device map asks for.

    A block placed on a device gets one hook moving all its weights there (and its submodules hooks moving their
    inputs); each tensor-holding submodule of an offloaded block gets an offloading hook.

    Args:
        module: The root module.
        execution_device: One device, or block names (device-map keys) to devices.
        offload: One flag, or block names to whether the block is offloaded.
        weights_map: The offloaded weights, by name from the root.
        offload_buffers: Offload the buffers too.
        module_name: ``module``'s name in the model.
        skip_keys: Keyword arguments left where they are.
        preload_module_classes: See :func:`attach_align_device_hook`.
        tied_params_map: Shared per-device copies of tied weights.

    """
    walk = _Walk(weights_map, offload_buffers, skip_keys, preload_module_classes, tied_params_map)
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            _attach_aligned(module, execution_device, True, module_name, replace(walk, preload_module_classes=None))
        else:
            hook = AlignDevicesHook(
                execution_device,
                io_same_device=True,
                skip_keys=skip_keys,
                place_submodules=True,
                tied_params_map=tied_params_map,
            )
            add_hook_to_module(module, hook)
        return

    devices = execution_device if isinstance(execution_device, Mapping) else dict.fromkeys(offload, execution_device)  # type: ignore[arg-type]
    offloads = offload if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    _attach_on_blocks(module, devices, offloads, module_name, walk)


def _attach_on_blocks(
    module: nn.Module,
    devices: Mapping[str, DeviceLike | None],
    offloads: Mapping[str, bool],
    module_name: str,
    walk: _Walk,
) -> None:
    at_root = module_name == ""
    if module_name in devices and module_name in offloads:
        device = devices[module_name]
        if not offloads[module_name]:
            hook = AlignDevicesHook(
                device,
                offload_buffers=walk.offload_buffers,
                io_same_device=at_root,
                place_submodules=True,
                skip_keys=walk.skip_keys,
                tied_params_map=walk.tied_params_map,
            )
            add_hook_to_module(module, hook)
            attach_execution_device_hook(module, device, skip_keys=walk.skip_keys, tied_params_map=walk.tied_params_map)
        else:
            _attach_aligned(module, device, True, module_name, walk)
            if not hasattr(module, "_hf_hook"):
                hook = AlignDevicesHook(
                    device, io_same_device=at_root, skip_keys=walk.skip_keys, tied_params_map=walk.tied_params_map
                )
                add_hook_to_module(module, hook)
            attach_execution_device_hook(
                module, device, walk.skip_keys, walk.preload_module_classes, walk.tied_params_map
            )
    elif at_root:
        hook = AlignDevicesHook(
            devices.get(""), io_same_device=True, skip_keys=walk.skip_keys, tied_params_map=walk.tied_params_map
        )
        add_hook_to_module(module, hook)
    for child_name, child in _named_children(module, module_name):
        _attach_on_blocks(child, devices, offloads, child_name, walk)
