"""The process-control half of the ``Accelerator`` API: who am I, and which process runs what.

Everything here answers from :class:`~lightning_accel.state.AcceleratorState`, which the ``Accelerator`` fills in
from its strategy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from lightning_accel.enums import DistributedType
from lightning_accel.state import AcceleratorState, PartialState
from lightning_accel.utils.operations import reduce

__all__ = ["ProcessControl"]

_F = TypeVar("_F", bound=Callable[..., Any])


class ProcessControl:
    """Mixin giving the ``Accelerator`` Accelerate's process information, decorators, triggers and helpers."""

    state: AcceleratorState
    flag_tensor: torch.Tensor | None = None

    @property
    def distributed_type(self) -> DistributedType:
        """The Accelerate type of the strategy in use."""
        return self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``."""
        return str(self.state.mixed_precision)

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self.state.device

    @property
    def num_processes(self) -> int:
        """Processes in the run."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """The global rank of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """The rank of this process on its node."""
        return self.state.local_process_index

    @property
    def use_distributed(self) -> bool:
        """Whether several processes take part."""
        return self.state.use_distributed

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 of its node."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the highest global rank."""
        return self.state.is_last_process

    def wait_for_everyone(self) -> None:
        """Block until every process gets here."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per node."""
        self.state.print(*args, **kwargs)

    @contextmanager
    def main_process_first(self) -> Generator[None, None, None]:
        """Run the body on the main process first, then on the others."""
        with self.state.main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Generator[None, None, None]:
        """Run the body on each node's main process first."""
        with self.state.local_main_process_first():
            yield

    def on_main_process(self, function: _F | None = None) -> Any:
        """Decorate ``function`` to run on the global main process only (elsewhere it returns ``None``).

        As in Accelerate it also decorates methods of an ``Accelerator`` subclass when used on the class
        (``@Accelerator.on_main_process``), where the method itself arrives as ``self``.
        """
        return _main_only(self, function, "on_main_process")

    def on_local_main_process(self, function: _F | None = None) -> Any:
        """Decorate ``function`` to run on each node's main process only (see :meth:`on_main_process`)."""
        return _main_only(self, function, "on_local_main_process")

    def on_last_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: _F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on global rank ``process_index`` only."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: _F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on local rank ``local_process_index`` of every node only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Generator[Any, None, None]:
        """Yield this process's share of ``inputs`` (see ``PartialState.split_between_processes``)."""
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as share:
            yield share

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` returns ``True`` on every process."""
        self.flag_tensor = torch.tensor(1, device=self.state.device)

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check (collective; resets the flags)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.state.device)
        raised = bool(reduce(flag, reduction="sum").item() >= 1)
        if raised:
            self.flag_tensor = None
        return raised


def _main_only(owner: Any, function: Callable[..., Any] | None, decorator: str) -> Callable[..., Any]:
    """Accelerate's decorator: ``function`` (or ``owner``, when used on the class) runs where the state says.

    Raises:
        ValueError: When called on an ``Accelerator`` without a function.

    """
    if function is None:
        if isinstance(owner, ProcessControl) or not callable(owner):
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
