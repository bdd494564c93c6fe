"""Gradient clipping and unscaling for the ``Accelerator``, as Accelerate's ``clip_grad_norm_`` computes it.

Accelerate clips with ``torch.nn.utils.clip_grad_norm_`` over the parameters it is given, in the order given, so the
float sum of the norms (and with it every clipped weight) depends on that order. The ``Accelerator`` does the same,
except where the norm must be computed another way: an FSDP1 model clips through its root module's
``clip_grad_norm_`` (its parameters are flat local shards) when the parameters are all of the model's, as Accelerate
does; a strategy that overrides Fabric's clipping (Megatron) clips its own way; DeepSpeed's engine clipped inside
``backward`` (see :mod:`lightning_accel._accelerator.engine_step`). FSDP2's parameters are ``DTensor`` shards, over
which torch's function computes the global norm itself.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import Strategy
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from lightning_utilities.core.overrides import is_overridden
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.optim import Optimizer

from lightning_accel._accelerator import engine_step as _engine_step
from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.optimizer import AcceleratedOptimizer
from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["GradientClipping", "raw_optimizer"]


class GradientClipping:
    """Accelerate's ``clip_grad_norm_``, ``clip_grad_value_`` and ``unscale_gradients``, delegated to by the shim.

    Args:
        fabric: The ``Accelerator``'s Fabric (its clipping and precision plugin).
        strategy: The Fabric's strategy, seen through :class:`~lightning_accel.strategies.protocol.ShimStrategy`.
        prepared: The prepared models and optimizers.

    """

    def __init__(self, *, fabric: Fabric, strategy: ShimStrategy, prepared: PreparedObjects) -> None:
        self.fabric = fabric
        self._strategy = strategy
        self._prepared = prepared

    def _owner(self, parameters: Any) -> tuple[list[Any], _FabricModule | None]:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        owners = [m for m in self._prepared.models if ids <= {id(p) for p in m.parameters()}]
        return params, (owners[0] if owners and self._prepared.optimizers else None)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | float | None:
        """See :meth:`lightning_accel.Accelerator.clip_grad_norm_`.

        Raises:
            ValueError: If ``max_norm`` is negative (it would flip the gradients' sign).

        """
        if max_norm < 0:
            raise ValueError(
                f"clip_grad_norm_ got max_norm={max_norm!r}; it must be >= 0 (a negative bound would flip the"
                " gradients' sign). Pass the largest gradient norm to allow, or do not call clip_grad_norm_."
            )
        strategy = self.fabric.strategy
        if self._strategy.engine_steps_in_backward:
            return _engine_step.global_grad_norm(self._strategy, max_norm)
        params, owner = self._owner(parameters)
        whole_model = owner is not None and len(params) == len(list(owner.parameters()))
        wrapper = fabric_forward_module(owner) if owner is not None else None
        if whole_model and isinstance(wrapper, FullyShardedDataParallel):  # FSDP1: flat shards, a global norm
            self.unscale_gradients()
            return wrapper.clip_grad_norm_(max_norm, norm_type)
        if owner is not None and whole_model and _clips_itself(strategy):
            norm = self.fabric.clip_gradients(
                owner,
                self._prepared.optimizers[0].optimizer,
                max_norm=max_norm,
                norm_type=norm_type,
                error_if_nonfinite=False,
            )
            return cast(torch.Tensor, norm)
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """See :meth:`lightning_accel.Accelerator.clip_grad_value_`."""
        _engine_step.refuse_value_clipping(self._strategy)
        params, _ = self._owner(parameters)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(params, clip_value)

    def unscale_gradients(self, optimizer: AcceleratedOptimizer | None = None) -> None:
        """See :meth:`lightning_accel.Accelerator.unscale_gradients`."""
        precision = self.fabric.strategy.precision
        if getattr(precision, "scaler", None) is None:
            return
        for opt in [optimizer] if optimizer is not None else self._prepared.optimizers:
            precision.unscale_gradients(raw_optimizer(opt))


def _clips_itself(strategy: Strategy) -> bool:
    """Whether ``strategy`` overrides Fabric's norm clipping (Megatron), rather than using torch's function."""
    return is_overridden("clip_gradients_norm", strategy, parent=Strategy)


def raw_optimizer(optimizer: AcceleratedOptimizer) -> Optimizer:
    """The user's optimizer inside an ``AcceleratedOptimizer`` and Fabric's wrapper."""
    inner = optimizer.optimizer
    return inner.optimizer if isinstance(inner, _FabricOptimizer) else inner
