"""Accelerate's DeepSpeed training step: the engine steps inside ``Accelerator.backward``.

Under DeepSpeed, HF accelerate runs ``engine.backward`` and, at a sync step, ``engine.step`` (clipping by the config's
``gradient_clipping``, optimizer step, zero_grad, overflow check) inside ``accelerator.backward``; the prepared
optimizer's ``step``/``zero_grad`` do nothing, and ``clip_grad_norm_`` returns the norm the engine measured in that
step (its ``max_norm`` is ignored). The ``Accelerator`` does the same through the functions here, so
``clip_grad_norm_`` after ``backward`` answers for the step just taken. A torch scheduler prepared with the model is
not given to the engine (Accelerate gives it only DeepSpeed's own schedulers): the user steps it, by Accelerate's
rules. A ``DummyScheduler`` comes back as the engine's scheduler, whose ``step`` does nothing (the engine steps it),
and ``clip_grad_value_`` is refused, as in Accelerate.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from lightning_accel.optimizer import AcceleratedOptimizer
from lightning_accel.scheduler import DeepSpeedSchedulerWrapper
from lightning_accel.strategies.protocol import ShimStrategy
from lightning_accel.utils.deepspeed import DummyScheduler, only_deepspeed_error

__all__ = [
    "SCHEDULERS",
    "engine_scheduler",
    "global_grad_norm",
    "refuse_value_clipping",
    "step_after_backward",
]

# What Accelerator.prepare treats as a scheduler.
SCHEDULERS = (LRScheduler, DummyScheduler)
_warned_max_norm: set[float] = set()


def step_after_backward(
    strategy: ShimStrategy, optimizers: Sequence[AcceleratedOptimizer], sync_gradients: bool
) -> None:
    """At a sync step, run the engine's ``step`` right after the backward pass (nothing on accumulating micro-steps).

    ``engine.step()`` itself, not only its optimizer's: it also keeps the engine's global norm (read by
    :func:`global_grad_norm`), step count and config-declared scheduler as Accelerate's step does.
    """
    if not sync_gradients or not strategy.engine_steps_in_backward:
        return
    engine = strategy.step_engine()
    if engine is None or engine.optimizer is None:
        return  # a model set up without an optimizer (inference) has nothing to step
    engine.step()
    for optimizer in optimizers:
        optimizer.record_engine_step()


def global_grad_norm(strategy: ShimStrategy, max_norm: float) -> float | None:
    """The gradient norm of the engine's last step, as Accelerate's ``clip_grad_norm_`` returns it under DeepSpeed.

    The engine has already clipped, by the config's ``gradient_clipping``; ``max_norm`` is ignored, as in Accelerate
    (with a warning, once per value, where it differs from the config's).

    Returns:
        The norm as a Python float, or ``None`` before the engine's first step (or without an engine).

    """
    engine = strategy.step_engine()
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
        stacklevel=5,  # the script that called Accelerator.clip_grad_norm_ (through GradientClipping)
    )


def engine_scheduler(
    strategy: ShimStrategy, scheduler: Any, optimizers: Sequence[AcceleratedOptimizer]
) -> DeepSpeedSchedulerWrapper | None:
    """What ``prepare`` returns for a ``DummyScheduler``: the engine's scheduler, stepped by the engine (Accelerate's).

    Args:
        strategy: The ``Accelerator``'s strategy.
        scheduler: The scheduler passed to ``prepare``.
        optimizers: The prepared optimizers.

    Returns:
        The wrapped engine scheduler, or ``None`` when ``scheduler`` is not a ``DummyScheduler``.

    Raises:
        ValueError: Without DeepSpeed, or when no engine built a scheduler (the ``DummyScheduler`` was not prepared
            in the same call as the model and its optimizer).

    """
    if not isinstance(scheduler, DummyScheduler):
        return None
    if not strategy.engine_steps_in_backward:
        raise only_deepspeed_error(scheduler=True)
    engine = strategy.step_engine()
    if engine is None or engine.lr_scheduler is None:
        raise ValueError(
            "DummyScheduler was prepared, but no DeepSpeed engine built a scheduler for it. Prepare it in the same"
            " accelerator.prepare call as the model and its optimizer, with a 'scheduler' section in the DeepSpeed"
            " config (lr_scheduler_callable is used only with a DummyOptim, as in Accelerate)."
        )
    return DeepSpeedSchedulerWrapper(engine.lr_scheduler, optimizers)


def refuse_value_clipping(strategy: ShimStrategy) -> None:
    """Refuse ``clip_grad_value_`` under DeepSpeed, as Accelerate does: the engine owns the (sharded) gradients.

    Raises:
        RuntimeError: Under DeepSpeed.

    """
    if strategy.engine_steps_in_backward:
        raise RuntimeError(
            "clip_grad_value_ is not supported under DeepSpeed (as in Accelerate): the engine clips the gradient norm"
            " itself inside accelerator.backward. Set the DeepSpeed config's gradient_clipping (or"
            " DeepSpeedPlugin(gradient_clipping=...)) instead, or call accelerator.clip_grad_norm_."
        )
