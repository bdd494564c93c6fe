"""``AcceleratedOptimizer``: an optimizer that steps only when gradients are synchronised."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.wrappers import _FabricOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.state import GradientState

__all__ = ["AcceleratedOptimizer"]


def _is_fabric_wrapper(optimizer: Any) -> bool:
    return isinstance(optimizer, _FabricOptimizer)


class AcceleratedOptimizer(Optimizer):
    """Wrap an optimizer set up by Fabric with Accelerate's accumulation rules.

    ``step`` and ``zero_grad`` do nothing on micro-steps that accumulate (``GradientState.sync_gradients`` false).
    ``step`` goes through the strategy and precision plugin (gradient scaling, DeepSpeed's engine).
    ``state``, ``param_groups`` and ``defaults`` are the wrapped optimizer's. Where the engine steps inside
    ``Accelerator.backward`` (DeepSpeed, as in Accelerate), ``step`` and ``zero_grad`` do nothing and the
    ``Accelerator`` calls :meth:`record_engine_step` after the engine's step.

    Args:
        optimizer: The optimizer Fabric returned from ``setup_optimizers`` (or a plain one).
        precision: The precision plugin, asked whether the last step was skipped (fp16 overflow).
        plain_step: The strategy and precision plugin add nothing to the step (see
            :func:`lightning_accel._shim.module.plain_optimizer_step`): step the user's optimizer directly.
        engine_steps: The engine steps inside ``Accelerator.backward`` (DeepSpeed): ``step``/``zero_grad`` are no-ops.

    """

    def __init__(
        self, optimizer: Optimizer, precision: Any = None, plain_step: bool = False, engine_steps: bool = False
    ) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.engine_steps = engine_steps
        self._stepper: Optimizer = getattr(optimizer, "optimizer", optimizer) if plain_step else optimizer
        self.gradient_state = GradientState()
        self._is_overflow = False

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, unless this micro-step accumulates (or the engine clears them in its step)."""
        if self.gradient_state.sync_gradients and not self.engine_steps:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer, unless this micro-step accumulates (or the engine stepped in ``backward``)."""
        if not self.gradient_state.sync_gradients or self.engine_steps:
            return None
        return self._step(closure)

    def record_engine_step(self) -> None:
        """Note the step the engine took in ``Accelerator.backward``: whether it skipped it (fp16 overflow).

        DeepSpeed's optimizers report the overflow as ``overflow``, which Accelerate's wrapper reads too.
        """
        self._is_overflow = bool(getattr(self.optimizer, "overflow", False))

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        result = self._stepper.step(closure) if closure is not None else self._stepper.step()
        self._is_overflow = bool(getattr(self.precision, "step_was_skipped", False))
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` was skipped by the gradient scaler (inf/NaN gradients in fp16)."""
        return self._is_overflow

    @override
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state."""
        self.optimizer.load_state_dict(state_dict)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["gradient_state"]  # process-wide; the copy joins the state of the process it is loaded in
        # Fabric's wrapper is a class made at run time, which pickle cannot name: the copy holds the user's optimizer.
        for key in ("optimizer", "_stepper"):
            state[key] = getattr(state[key], "optimizer", state[key]) if _is_fabric_wrapper(state[key]) else state[key]
        return state

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    @override
    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"
