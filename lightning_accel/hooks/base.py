"""The hook mechanism: a :class:`ModelHook` runs around a module's ``forward`` and sees its keyword arguments too.

:func:`add_hook_to_module` keeps the module's own ``forward`` as ``_old_forward`` and stores the hook as ``_hf_hook``
(Accelerate's attribute names, so a model hooked by either library is recognised by the other's helpers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from typing_extensions import override

__all__ = [
    "GUARDED_MOVE_METHODS",
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]

_F = TypeVar("_F", bound=Callable[..., Any])
# Device-moving methods dispatch_model shadows on an instance (with a warning); removing hooks restores them.
GUARDED_MOVE_METHODS = ("to", "cuda", "xpu", "npu", "mlu", "sdaa", "musa", "hpu", "neuron")


def _eager(function: _F) -> _F:
    """Run ``function`` outside torch.compile's graphs (wrapped on first call: importing dynamo costs seconds)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        compiled = wrapper.__dict__.get("_eager_function")
        if compiled is None:
            compiled = wrapper.__dict__["_eager_function"] = torch.compiler.disable(function)
        return compiled(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class ModelHook:
    """Callbacks around a module's ``forward`` that receive its positional and keyword arguments.

    Attributes:
        no_grad: Run the module's ``forward`` under ``torch.no_grad()``.

    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached to ``module``; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called before ``forward``; returns the (possibly changed) ``args`` and ``kwargs``."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after ``forward``; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed from ``module``; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run one after the other at each event, in the order given."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    @override
    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    @override
    @_eager
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    @override
    @_eager
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    @override
    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook: ModelHook = module.__dict__["_hf_hook"]
    own_forward = module.__dict__["_old_forward"]
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = own_forward(*args, **kwargs)
    else:
        output = own_forward(*args, **kwargs)
    return hook.post_forward(module, output)


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    # An fx GraphModule's forward is looked up on its class: an instance attribute would freeze its graph.
    if "GraphModuleImpl" in str(type(module)):
        type(module).forward = forward
    else:
        module.__dict__["forward"] = forward


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Run ``hook`` around ``module``'s ``forward`` (which keeps its name and signature).

    A hook already attached is replaced, or with ``append=True`` chained with the new one in a
    :class:`SequentialHook`.

    Args:
        module: The module (changed in place).
        hook: The hook.
        append: Chain with the current hook instead of replacing it.

    Returns:
        ``module``.

    """
    previous: ModelHook | None = module.__dict__.get("_hf_hook")
    if append and previous is not None:
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__:
        original = module.__dict__["_old_forward"]
    else:
        original = module.forward
        module.__dict__["_old_forward"] = original
    module = hook.init_hook(module)
    module.__dict__["_hf_hook"] = hook
    _set_forward(module, functools.update_wrapper(functools.partial(_hooked_forward, module), original))
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` and give it back its own ``forward`` (and ``to``, if dispatch shadowed it).

    Args:
        module: The module (changed in place).
        recurse: Do the same for every submodule.

    Returns:
        ``module``.

    """
    hook: ModelHook | None = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    original = module.__dict__.pop("_old_forward", None)
    if original is not None:
        _set_forward(module, original)
    for method in GUARDED_MOVE_METHODS:
        module.__dict__.pop(method, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and of all its submodules."""
    remove_hook_from_module(module, recurse=True)
