"""``AcceleratedScheduler``: a learning-rate scheduler stepped by Accelerate's rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from lightning_accel.optimizer import AcceleratedOptimizer
from lightning_accel.state import GradientState, PartialState

__all__ = ["AcceleratedScheduler", "DeepSpeedSchedulerWrapper", "MegatronLMSchedulerWrapper"]


class AcceleratedScheduler:
    """Step a scheduler once per optimizer step and process, as Accelerate does.

    With ``step_with_optimizer`` (the default), ``step()`` does nothing on accumulating micro-steps or when an
    optimizer skipped its step; otherwise it steps ``num_processes`` times (once with ``split_batches``), so a schedule
    written in "samples seen by one process" covers the same data on any number of processes.

    Args:
        scheduler: The scheduler to wrap.
        optimizers: The prepared optimizers it belongs to.
        step_with_optimizer: Follow the optimizer's steps (else ``step()`` always steps once).
        split_batches: Batches are split across processes (one step per optimizer step).

    """

    def __init__(
        self,
        scheduler: LRScheduler,
        optimizers: Sequence[AcceleratedOptimizer],
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule by Accelerate's rules (see the class docstring)."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        repeats = 1 if self.split_batches else PartialState().num_processes
        for _ in range(repeats):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its last step
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[Any]:
        """The learning rates of the last step."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> list[Any]:
        """The wrapped scheduler's ``get_lr``."""
        return list(self.scheduler.get_lr())

    def print_lr(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped scheduler's ``print_lr``."""
        self.scheduler.print_lr(*args, **kwargs)  # type: ignore[attr-defined]


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """The engine's scheduler as ``prepare`` returns it: the engine steps it in ``backward``, so ``step`` does nothing.

    ``get_last_lr``, ``state_dict`` and the other methods are the engine scheduler's.
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing: ``accelerator.backward`` stepped the engine, and with it this scheduler (as in Accelerate)."""


class MegatronLMSchedulerWrapper(AcceleratedScheduler):
    """A scheduler prepared with a pipeline-parallel Megatron model: the model's training step steps it.

    As Accelerate's wrapper of the same name: calling the prepared model runs the whole step (the optimizer's, then
    one step of this scheduler), so ``step`` does nothing; ``get_last_lr``, ``state_dict`` and the others are the
    scheduler's.
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing: the prepared model's forward stepped the scheduler (as in Accelerate)."""
