"""Reading the weights of an offloaded model: bring a module's weights onto a device for a while, or gather them all.

A module is offloaded when its hook (an ``AlignDevicesHook`` with ``offload=True``, attached by ``cpu_offload``,
``disk_offload`` or ``dispatch_model``) keeps its weights in a weights map and the module itself holds meta tensors.
The hook is recognised by its ``offload`` flag and ``execution_device``, so this layer does not import the hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_accel.utils.modeling.tensors import DeviceLike, set_module_tensor_to_device

__all__ = [
    "align_module_device",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
]

logger = logging.getLogger(__name__)


def _offloading_hook(module: nn.Module) -> Any:
    """The hook keeping ``module``'s weights offloaded: its hook, or one chained in its ``SequentialHook``."""
    hook = getattr(module, "_hf_hook", None)
    for candidate in (hook, *getattr(hook, "hooks", ())):
        if hasattr(candidate, "execution_device") and getattr(candidate, "offload", False) is True:
            return candidate
    return None


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether a hook of ``module`` keeps its weights offloaded (on the meta device outside ``forward``).

    A hook chained after another one (the model's own, for the root module of ``cpu_offload``) counts too;
    Accelerate only looks at a single hook.
    """
    return _offloading_hook(module) is not None


@contextmanager
def align_module_device(module: nn.Module, execution_device: DeviceLike | None = None) -> Iterator[None]:
    """Inside the block, ``module``'s own parameters are on a real device.

    An offloaded module has its weights loaded onto its hook's execution device (or ``execution_device``) and
    offloaded again afterwards; any other module has its direct parameters moved to ``execution_device`` and back
    (nothing happens without one).

    Args:
        module: The module.
        execution_device: Where to put the parameters (default: the hook's execution device).

    """
    hook = _offloading_hook(module)
    if hook is not None:
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
    elif execution_device is not None:
        devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a (possibly offloaded) model on the CPU, loading one module's weights at a time.

    Raises:
        MemoryError: When a module's weights do not fit in CPU memory.

    """
    state_dict: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        try:
            with align_module_device(module, "cpu"):
                own = {key: value for key, value in module.state_dict().items() if "." not in key}
                for key, value in own.items():
                    if value.device.type != "meta":
                        state_dict[f"{prefix}.{key}" if prefix else key] = value.to("cpu")
        except MemoryError:
            raise MemoryError("Offloaded module must fit in CPU memory to call save_model!") from None
    missing = set(model.state_dict()) - set(state_dict)
    if missing:
        logger.warning(f"The following tensors were not saved because they were still on meta device: {missing}")
    return state_dict


def get_state_dict_from_offload(
    module: nn.Module,
    module_name: str,
    state_dict: MutableMapping[str, Any],
    device_to_put_offload: DeviceLike = "cpu",
) -> MutableMapping[str, Any]:
    """Fill the entries of ``state_dict`` that belong to ``module`` with its weights, loaded if it is offloaded.

    Args:
        module: The module.
        module_name: The name of one of its tensors in the model (``"block.linear.weight"``): its module's prefix
            selects the entries.
        state_dict: The state dict to update (in place).
        device_to_put_offload: Where offloaded weights are loaded to.

    Returns:
        ``state_dict``.

    """
    root = module_name[: module_name.rfind(".")]
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, value in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = value
    return state_dict
