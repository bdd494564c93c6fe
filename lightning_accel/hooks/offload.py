"""Whole-model CPU offload (:class:`CpuOffload`) and storage-dtype casting (:class:`LayerwiseCastingHook`)."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_accel.hooks.base import ModelHook, _eager, add_hook_to_module, remove_hook_from_module
from lightning_accel.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from lightning_accel.utils.memory import clear_device_cache
from lightning_accel.utils.modeling.tensors import DeviceLike, resolve_device
from lightning_accel.utils.operations import send_to_device

__all__ = [
    "CpuOffload",
    "LayerwiseCastingHook",
    "UserCpuOffloadHook",
    "attach_layerwise_casting_hooks",
]

logger = logging.getLogger(__name__)


def _default_execution_device() -> torch.device:
    """The machine's current accelerator device (MPS, CUDA, XPU, ...), or the CPU without one."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class CpuOffload(ModelHook):
    """Keep a model on the CPU until its ``forward``, then leave it on the execution device.

    It goes back to the CPU when :meth:`init_hook` is called again (``UserCpuOffloadHook.offload``), or when the
    next model of a pipeline, hooked with this model's hook as ``prev_module_hook``, runs.

    Args:
        execution_device: Where the model runs (default: the machine's accelerator, else the CPU).
        prev_module_hook: The previous pipeline model's hook, offloaded before this model runs.

    """

    def __init__(
        self, execution_device: DeviceLike | None = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        self.prev_module_hook = prev_module_hook
        self.execution_device = execution_device if execution_device is not None else _default_execution_device()

    @override
    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    @override
    @_eager
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(self.prev_module_hook, UserCpuOffloadHook):
            previous = next(self.prev_module_hook.model.parameters())
            if previous.device.type != "cpu":
                self.prev_module_hook.offload()
                clear_device_cache()
        device = resolve_device(self.execution_device)
        if next(module.parameters()).device == device:
            return args, kwargs
        module.to(device)
        return send_to_device(args, device), send_to_device(kwargs, device)


class UserCpuOffloadHook:
    """A model and its :class:`CpuOffload` hook, as :func:`cpu_offload_with_hook` returns them.

    Args:
        model: The hooked model.
        hook: Its hook.

    """

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Send the model back to the CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook from the model."""
        remove_hook_from_module(self.model)


class LayerwiseCastingHook(ModelHook):
    """Store a module's weights in ``storage_dtype`` and cast them to ``compute_dtype`` for its ``forward`` only.

    Args:
        storage_dtype: The dtype between calls (``torch.float8_e4m3fn``, for instance).
        compute_dtype: The dtype during ``forward``.
        non_blocking: Asynchronous casts.

    """

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    @override
    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    @override
    @_eager
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @override
    @_eager
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | list[str] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Keep the weights of ``module``'s linear and convolution layers in ``storage_dtype``, computing in another.

    A memory saving short of quantization: float8 storage with bfloat16 compute, for instance.

    Args:
        module: The model; with neither skip argument given and a supported layer passed, that layer alone is cast.
        storage_dtype: The dtype weights are kept in between calls.
        compute_dtype: The dtype each layer's weights take for its ``forward``.
        skip_modules_pattern: Regular expressions; submodules whose name matches one are left as they are.
        skip_modules_classes: Submodule classes left as they are.
        non_blocking: Asynchronous casts.

    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else skip_modules_pattern
    _attach_layerwise_casting(module, storage_dtype, compute_dtype, patterns, skip_modules_classes, non_blocking, "")


def _attach_layerwise_casting(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    patterns: tuple[str, ...] | list[str] | None,
    skip_classes: tuple[type[nn.Module], ...] | None,
    non_blocking: bool,
    name: str,
) -> None:
    if (skip_classes is not None and isinstance(module, skip_classes)) or (
        patterns is not None and any(re.search(pattern, name) for pattern in patterns)
    ):
        logger.debug(f'Skipping layerwise casting for layer "{name}"')
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        logger.debug(f'Applying layerwise casting to layer "{name}"')
        hook = LayerwiseCastingHook(storage_dtype=storage_dtype, compute_dtype=compute_dtype, non_blocking=non_blocking)
        add_hook_to_module(module, hook, append=True)
        return
    for child_name, child in module.named_children():
        child_path = f"{name}.{child_name}" if name else child_name
        _attach_layerwise_casting(child, storage_dtype, compute_dtype, patterns, skip_classes, non_blocking, child_path)
