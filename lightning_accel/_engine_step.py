"""Accelerate's DeepSpeed training step: the engine steps inside ``Accelerator.backward``.

Under DeepSpeed, HF accelerate runs ``engine.backward`` and, at a sync step, ``engine.step`` (clipping by the config's
``gradient_clipping``, optimizer step, zero_grad, overflow check) inside ``accelerator.backward``; the prepared
optimizer's ``step``/``zero_grad`` do nothing, and ``clip_grad_norm_`` returns the norm the engine measured in that
step (its ``max_norm`` is ignored). The ``Accelerator`` does the same through the functions here, so
``clip_grad_norm_`` after ``backward`` answers for the step just taken. A torch scheduler prepared with the model is
not given to the engine (Accelerate gives it only DeepSpeed's own schedulers): the user steps it, by Accelerate's
rules.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.fabric.strategies import DeepSpeedStrategy, Strategy

from lightning_accel.optimizer import AcceleratedOptimizer

__all__ = ["engine_steps_in_backward", "global_grad_norm", "step_after_backward"]

_warned_max_norm: set[float] = set()


def engine_steps_in_backward(strategy: Strategy) -> bool:
    """Whether ``strategy``'s engine takes the optimizer step inside ``backward`` (DeepSpeed), as in Accelerate."""
    return isinstance(strategy, DeepSpeedStrategy)


def step_after_backward(strategy: Strategy, optimizers: Sequence[AcceleratedOptimizer], sync_gradients: bool) -> None:
    """At a sync step, run the engine's ``step`` right after the backward pass (nothing on accumulating micro-steps).

    ``engine.step()`` itself, not only its optimizer's: it also keeps the engine's global norm (read by
    :func:`global_grad_norm`), step count and config-declared scheduler as Accelerate's step does.
    """
    if not sync_gradients or not engine_steps_in_backward(strategy):
        return
    engine: Any = getattr(strategy, "_deepspeed_engine", None)
    if engine is None or engine.optimizer is None:
        return  # a model set up without an optimizer (inference) has nothing to step
    engine.step()
    for optimizer in optimizers:
        optimizer.record_engine_step()


def global_grad_norm(strategy: Strategy, max_norm: float) -> float | None:
    """The gradient norm of the engine's last step, as Accelerate's ``clip_grad_norm_`` returns it under DeepSpeed.

    The engine has already clipped, by the config's ``gradient_clipping``; ``max_norm`` is ignored, as in Accelerate
    (with a warning, once per value, where it differs from the config's).

    Returns:
        The norm as a Python float, or ``None`` before the engine's first step (or without an engine).

    """
    engine: Any = getattr(strategy, "_deepspeed_engine", None)
    if engine is None:
        return None
    _warn_if_ignored(float(engine.gradient_clipping()), max_norm)
    norm = engine.get_global_grad_norm()
    return float(norm.item()) if hasattr(norm, "item") else norm


def _warn_if_ignored(configured: float, max_norm: float) -> None:
    if math.isclose(configured, max_norm) or max_norm in _warned_max_norm:
        return
    _warned_max_norm.add(max_norm)
    warnings.warn(
        f"Under DeepSpeed the engine clips inside `accelerator.backward` by the config's gradient_clipping"
        f" ({configured}); clip_grad_norm_'s max_norm={max_norm} is ignored, as in Accelerate. Set"
        " DeepSpeedPlugin(gradient_clipping=...) (or the config's entry) to change it.",
        UserWarning,
        stacklevel=4,  # the script that called Accelerator.clip_grad_norm_
    )
