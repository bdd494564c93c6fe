"""LOMO optimizers (``lomo_optim``'s ``Lomo``/``AdaLomo``): the update happens inside the backward pass.

A LOMO optimizer registers hooks on the parameters and applies each gradient as it is computed
(``fused_backward(loss, lr)``), so its ``step`` does nothing. ``Accelerator.backward(loss, learning_rate=lr)`` runs
:func:`lomo_backward` over the prepared optimizers when one is a LOMO optimizer, as in Accelerate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_accel.optimizer import AcceleratedOptimizer, is_lomo_optimizer
from lightning_accel.utils.imports import is_lomo_available

__all__ = ["has_lomo_optimizer", "lomo_backward"]


def has_lomo_optimizer(optimizers: Sequence[AcceleratedOptimizer]) -> bool:
    """Whether one of the prepared ``optimizers`` is a LOMO optimizer."""
    return any(is_lomo_optimizer(optimizer.optimizer) for optimizer in optimizers)


def lomo_backward(optimizers: Sequence[AcceleratedOptimizer], loss: torch.Tensor, learning_rate: float) -> None:
    """Backpropagate ``loss`` through every LOMO optimizer among ``optimizers``, which update the parameters.

    Raises:
        ImportError: Without the ``lomo-optim`` package.
        ValueError: Without a learning rate, or when no prepared optimizer is a LOMO optimizer.

    """
    if not is_lomo_available():
        raise ImportError("lomo_backward needs the LOMO optimizers: pip install lomo-optim.")
    if learning_rate is None:
        raise ValueError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
    lomo = [opt.optimizer for opt in optimizers if is_lomo_optimizer(opt.optimizer)]
    if not lomo:
        raise ValueError(
            "Backward pass not properly called on LOMO optimizers: pass a lomo_optim.Lomo or AdaLomo optimizer to"
            " accelerator.prepare() first."
        )
    for optimizer in lomo:
        inner: Any = getattr(optimizer, "optimizer", optimizer)
        inner.fused_backward(loss, learning_rate)
