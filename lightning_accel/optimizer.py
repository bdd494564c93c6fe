"""``AcceleratedOptimizer``: an optimizer that steps only when gradients are synchronised."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.wrappers import _FabricOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.state import AcceleratorState, GradientState
from lightning_accel.utils.operations import honor_type

__all__ = ["AcceleratedOptimizer", "DeepSpeedOptimizerWrapper", "move_to_device", "patch_optimizer_step"]


def _is_fabric_wrapper(optimizer: Any) -> bool:
    return isinstance(optimizer, _FabricOptimizer)


def _direct_zero_grad(optimizer: Any) -> Optimizer | None:
    """The user's optimizer inside Fabric's wrapper ``optimizer``, where clearing it directly is the same call.

    The wrapper's ``zero_grad`` is the user's optimizer class's; where that is torch's own, which only reads the
    optimizer's attributes (the wrapper forwards each read to the user's optimizer), calling it on the user's optimizer
    does the same work without four forwarded lookups per step. ``None`` otherwise: clear through the wrapper.
    """
    if not _is_fabric_wrapper(optimizer) or type(optimizer).zero_grad is not Optimizer.zero_grad:
        return None
    inner = optimizer.optimizer
    return inner if hasattr(inner, "_zero_grad_profile_name") else None


def move_to_device(state: Any, device: torch.device | str | int) -> Any:
    """Move the tensors in ``state`` (nested lists, tuples and dicts, e.g. an optimizer state dict) to ``device``."""
    if isinstance(state, (list, tuple)):
        return honor_type(state, (move_to_device(item, device) for item in state))
    if isinstance(state, dict):
        return type(state)({key: move_to_device(value, device) for key, value in state.items()})
    if isinstance(state, torch.Tensor):
        return state.to(device)
    return state


def patch_optimizer_step(accelerated_optimizer: AcceleratedOptimizer, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an optimizer's ``step`` so calling it marks ``accelerated_optimizer._accelerate_step_called``.

    A ``GradScaler`` skips the step on inf/NaN gradients; the mark tells whether it did (Accelerate's device).
    """

    def patched_step(*args: Any, **kwargs: Any) -> Any:
        accelerated_optimizer._accelerate_step_called = True
        return method(*args, **kwargs)

    return patched_step


def is_lomo_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ``lomo_optim``'s ``Lomo`` or ``AdaLomo`` (which step inside the backward pass).

    Read from the loaded module only: an optimizer of that package exists only once the package was imported.
    """
    lomo = sys.modules.get("lomo_optim")
    if lomo is None:
        return False
    return isinstance(getattr(optimizer, "optimizer", optimizer), (lomo.Lomo, lomo.AdaLomo))


def _state_off_device(optimizer: Optimizer, device: torch.device) -> bool:
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return any(t.device != device for t in tensors if t.dim() > 0 or t.device.type != "cpu")


class AcceleratedOptimizer(Optimizer):
    """Wrap an optimizer set up by Fabric with Accelerate's accumulation rules.

    ``step`` and ``zero_grad`` do nothing on micro-steps that accumulate (``GradientState.sync_gradients`` false).
    ``step`` goes through the strategy and precision plugin (gradient scaling, DeepSpeed's engine).
    ``state``, ``param_groups`` and ``defaults`` are the wrapped optimizer's. Where the engine steps inside
    ``Accelerator.backward`` (DeepSpeed, as in Accelerate), ``step`` and ``zero_grad`` do nothing and the
    ``Accelerator`` calls :meth:`record_engine_step` after the engine's step.

    Built directly, as in Accelerate (``AcceleratedOptimizer(optimizer, device_placement, scaler)``), it moves the
    optimizer's state to the state's device and steps through ``scaler`` (``scaler.step`` then ``scaler.update``).

    Args:
        optimizer: The optimizer Fabric returned from ``setup_optimizers`` (or a plain one).
        device_placement: Move the optimizer's state to ``AcceleratorState().device`` (where it is elsewhere).
        scaler: A ``torch.amp.GradScaler`` to step through (the ``Accelerator`` passes ``precision`` instead).
        precision: The precision plugin, asked whether the last step was skipped (fp16 overflow).
        plain_step: The strategy and precision plugin add nothing to the step (see
            :func:`lightning_accel._accelerator.module.plain_optimizer_step`): step the user's optimizer directly.
        engine_steps: The engine steps inside ``Accelerator.backward`` (DeepSpeed): ``step``/``zero_grad`` are no-ops.

    """

    _zero_grad_target: Optimizer | None = None  # the class default: a copy pickled before the attribute existed

    def __init__(
        self,
        optimizer: Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
        *,
        precision: Any = None,
        plain_step: bool = False,
        engine_steps: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.device_placement = device_placement
        self.scaler = scaler
        self.precision = precision
        self.engine_steps = engine_steps
        self._stepper: Optimizer = getattr(optimizer, "optimizer", optimizer) if plain_step else optimizer
        self._zero_grad_target = _direct_zero_grad(optimizer)
        self.gradient_state = GradientState()
        self._is_overflow = False
        self._accelerate_step_called = False
        if device_placement and AcceleratorState._shared_state:
            device = AcceleratorState().device
            if _state_off_device(optimizer, device):
                optimizer.load_state_dict(move_to_device(optimizer.state_dict(), device))

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
            if self._zero_grad_target is None:
                self.optimizer.zero_grad(set_to_none=set_to_none)
            else:
                Optimizer.zero_grad(self._zero_grad_target, set_to_none)

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer, unless this micro-step accumulates (or the engine stepped in ``backward``)."""
        if not self.gradient_state.sync_gradients or self.engine_steps:
            return None
        if "lomo_optim" in sys.modules and is_lomo_optimizer(self._stepper):
            return None  # LOMO updates the parameters in its fused backward pass
        if self.scaler is not None:
            return self._scaled_step(closure)
        result = self._stepper.step(closure) if closure is not None else self._stepper.step()
        self._is_overflow = bool(getattr(self.precision, "step_was_skipped", False))
        return result

    def record_engine_step(self) -> None:
        """Note the step the engine took in ``Accelerator.backward``: whether it skipped it (fp16 overflow).

        DeepSpeed's optimizers report the overflow as ``overflow``, which Accelerate's wrapper reads too.
        """
        self._is_overflow = bool(getattr(self.optimizer, "overflow", False))

    def _scaled_step(self, closure: Callable[[], Any] | None) -> Any:
        """``scaler.step`` and ``scaler.update``; the step counts as skipped when the scaler did not call it."""
        assert self.scaler is not None
        original = self._stepper.step
        self._stepper.step = patch_optimizer_step(self, original)  # type: ignore[method-assign]
        try:
            result = (
                self.scaler.step(self._stepper, closure) if closure is not None else self.scaler.step(self._stepper)
            )
            self.scaler.update()
        finally:
            self._stepper.step = original  # type: ignore[method-assign]
        self._is_overflow, self._accelerate_step_called = not self._accelerate_step_called, False
        return result

    def train(self) -> None:
        """Put an optimizer with modes (schedule-free's) in training mode; a no-op for the others."""
        _call_mode(self.optimizer, "train")

    def eval(self) -> None:
        """Put an optimizer with modes (schedule-free's) in evaluation mode; a no-op for the others."""
        _call_mode(self.optimizer, "eval")

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


def _call_mode(optimizer: Any, mode: str) -> None:
    """Call ``optimizer.<mode>()``, or the inner optimizer's where a wrapper (Fabric's, DeepSpeed's) holds one."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None), getattr(optimizer, "_optimizer", None)):
        method = getattr(candidate, mode, None) if candidate is not None else None
        if callable(method) and not isinstance(candidate, AcceleratedOptimizer):
            method()
            return


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """What ``Accelerator.prepare`` returns for an optimizer under DeepSpeed (``accelerate.utils``'s class).

    The engine steps and zeroes the gradients inside ``accelerator.backward``, so ``step`` and ``zero_grad`` do
    nothing; :attr:`step_was_skipped` is the engine optimizer's ``overflow`` (fp16), as in Accelerate.

    Args:
        optimizer: The optimizer the engine steps (DeepSpeed's, or the one Fabric set up with the engine).
        precision: The precision plugin of the run, if any.

    """

    def __init__(self, optimizer: Optimizer, *, precision: Any = None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None, precision=precision, engine_steps=True)

    @property
    @override
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped its last step (fp16 overflow)."""
        return bool(getattr(self.optimizer, "overflow", False))
