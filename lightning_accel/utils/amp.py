"""Accelerate's mixed-precision helpers, answered by this package's precision plugins."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from lightning_accel.config import AutocastKwargs
from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.precision import BF16Precision, FP16Precision
from lightning_accel.precision.base import AcceleratePrecision, default_device_type
from lightning_accel.state import AcceleratorState

__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager"]

# fp8 layers run their own matmuls; everything around them autocasts to bf16, as in Accelerate.
_AUTOCAST_PLUGIN: dict[str, Callable[..., AcceleratePrecision]] = {
    PrecisionType.FP16.value: FP16Precision,
    PrecisionType.BF16.value: BF16Precision,
    PrecisionType.FP8.value: BF16Precision,
}


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None) -> Any:
    """The autocast context of the run's ``mixed_precision`` (from :class:`~lightning_accel.state.AcceleratorState`).

    Args:
        native_amp: Whether mixed precision is on at all; ``False`` gives a no-op context.
        autocast_kwargs: ``enabled`` / ``cache_enabled`` for ``torch.autocast``.

    Returns:
        ``torch.autocast`` on the state's device in fp16 (``"fp16"``) or bf16 (``"bf16"``, ``"fp8"``); a no-op context
        when ``native_amp`` is off or the precision is ``"no"``.

    Raises:
        ValueError: For fp16 on CPU (fp16 autocast needs a GPU; use bf16), as the precision plugin does.

    """
    state = AcceleratorState()
    plugin = _AUTOCAST_PLUGIN.get(str(state.mixed_precision)) if native_amp else None
    if plugin is None:
        return nullcontext()
    return plugin(device=state.device.type, autocast_kwargs=autocast_kwargs).forward_context()


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A gradient scaler for the current accelerator: FSDP's ``ShardedGradScaler`` under FSDP, else ``torch.amp``'s.

    Args:
        distributed_type: The run's distributed type (only ``FSDP`` changes the scaler).
        **kwargs: ``GradScaler`` arguments (``init_scale``, ``growth_factor``, ``backoff_factor``, ...).

    """
    device = default_device_type()
    if device == "cpu":
        device = "cuda"  # as Accelerate: without CUDA, torch disables this scaler with a warning
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
