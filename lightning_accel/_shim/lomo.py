"""LOMO optimizers (``lomo_optim``'s ``Lomo``/``AdaLomo``): the update happens inside the backward pass.

A LOMO optimizer registers hooks on the parameters and applies each gradient as it is computed
(``fused_backward(loss, lr)``), so its ``step`` does nothing. ``Accelerator.backward(loss, learning_rate=lr)`` runs
:meth:`LomoControl.lomo_backward` when a LOMO optimizer is prepared, as in Accelerate.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_accel.optimizer import AcceleratedOptimizer, is_lomo_optimizer
from lightning_accel.utils.imports import is_lomo_available

__all__ = ["LomoControl"]


class LomoControl:
    """Accelerate's ``has_lomo_optimizer`` and ``lomo_backward``, for the ``Accelerator``."""

    _optimizers: list[AcceleratedOptimizer]

    @property
    def has_lomo_optimizer(self) -> bool:
        """Whether a prepared optimizer is a LOMO optimizer."""
        return any(is_lomo_optimizer(optimizer.optimizer) for optimizer in self._optimizers)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backpropagate ``loss`` through every prepared LOMO optimizer, which updates the parameters on the way.

        Raises:
            ImportError: Without the ``lomo-optim`` package.
            ValueError: Without a learning rate, or when no prepared optimizer is a LOMO optimizer.

        """
        if not is_lomo_available():
            raise ImportError("lomo_backward needs the LOMO optimizers: pip install lomo-optim.")
        if learning_rate is None:
            raise ValueError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
        lomo = [opt.optimizer for opt in self._optimizers if is_lomo_optimizer(opt.optimizer)]
        if not lomo:
            raise ValueError(
                "Backward pass not properly called on LOMO optimizers: pass a lomo_optim.Lomo or AdaLomo optimizer to"
                " accelerator.prepare() first."
            )
        for optimizer in lomo:
            inner: Any = getattr(optimizer, "optimizer", optimizer)
            inner.fused_backward(loss, learning_rate)
