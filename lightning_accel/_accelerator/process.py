"""The ``Accelerator``'s process helpers: the breakpoint trigger and the main-process decorators.

Everything else about processes the ``Accelerator`` answers from :class:`~lightning_accel.state.AcceleratorState`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from lightning_accel.state import AcceleratorState, PartialState
from lightning_accel.utils.operations import reduce

__all__ = ["Trigger", "main_only"]


class Trigger:
    """Accelerate's ``set_trigger``/``check_trigger``: a flag any process raises and every process then sees.

    Args:
        state: The shared process state (the flag's device).

    Attributes:
        flag_tensor: This process's raised flag, ``None`` while it is down (Accelerate's attribute).

    """

    def __init__(self, *, state: AcceleratorState) -> None:
        self._state = state
        self.flag_tensor: torch.Tensor | None = None

    def set(self) -> None:
        """Raise this process's flag."""
        self.flag_tensor = torch.tensor(1, device=self._state.device)

    def check(self) -> bool:
        """Whether any process raised its flag since the last check (collective; lowers the flags)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self._state.device)
        raised = bool(reduce(flag, reduction="sum").item() >= 1)
        if raised:
            self.flag_tensor = None
        return raised


def main_only(owner: object, function: Callable[..., Any] | None, decorator: str) -> Callable[..., Any]:
    """Accelerate's decorator: ``function`` (or ``owner``, when used on the class) runs where the state says.

    Raises:
        ValueError: When called on an ``Accelerator`` without a function.

    """
    if function is None:
        if not (inspect.isfunction(owner) or inspect.ismethod(owner)):
            raise ValueError(
                f"The `{decorator}` decorator must be called with a function on an instantiated `Accelerator`"
                f" object: use @accelerator.{decorator} (no parentheses) or accelerator.{decorator}(function)."
            )
        function = owner
    target = function

    @functools.wraps(target)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return getattr(PartialState(), decorator)(target)(*args, **kwargs)

    return inner
