"""Precision plugins for Accelerate's ``no``, ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch

from lightning_accel.config import AutocastKwargs, GradScalerKwargs
from lightning_accel.precision.base import AcceleratePrecision, Mode
from lightning_accel.utils.modeling import FP16_NEEDS_A_GPU, autocast_problem


class FP32Precision(AcceleratePrecision):
    """Full precision (Accelerate's ``no``).

    Args:
        tf32: Let float32 matmuls use TensorFloat-32 on GPUs that have it (``torch.set_float32_matmul_precision``).

    """

    precision_type = "no"

    def __init__(self, tf32: bool = False) -> None:
        super().__init__(torch.float32)
        self.tf32 = tf32
        if tf32:
            torch.set_float32_matmul_precision("high")


class BF16Precision(AcceleratePrecision):
    """bfloat16 (Accelerate's ``bf16``): autocast on CPU or GPU, or the whole model in bf16 with ``mode="true"``.

    Args:
        mode: ``"mixed"`` (autocast, fp32 weights) or ``"true"`` (bf16 weights).
        device: The device type; ``None`` lets the strategy set it.
        autocast_kwargs: Accelerate's ``AutocastKwargs``.

    """

    precision_type = "bf16"

    def __init__(
        self, mode: Mode = "mixed", device: str | None = None, autocast_kwargs: AutocastKwargs | None = None
    ) -> None:
        super().__init__(torch.bfloat16, mode=mode, device=device, autocast_kwargs=autocast_kwargs)

    def check_device(self, device_type: str) -> None:
        """bf16 runs on CPU; on CUDA it needs a GPU with native bf16 support (Ampere or newer).

        Raises:
            ValueError: On a GPU without native bf16 (one that would only emulate it, much slower).

        """
        problem = autocast_problem(device_type, torch.bfloat16)
        if problem is not None:
            raise ValueError(problem)


class FP16Precision(AcceleratePrecision):
    """float16 (Accelerate's ``fp16``): autocast with a gradient scaler, or the whole model in fp16.

    Args:
        mode: ``"mixed"`` (autocast, fp32 weights, loss scaling) or ``"true"`` (fp16 weights, no scaler).
        device: The device type; ``None`` lets the strategy set it.
        autocast_kwargs: Accelerate's ``AutocastKwargs``.
        scaler_kwargs: Accelerate's ``GradScalerKwargs`` (initial scale, growth, backoff, interval, enabled).
        scaler: Your own ``torch.amp.GradScaler`` (e.g. from Lightning's ``MixedPrecision(..., scaler=...)``), used
            as it is instead of one built from ``scaler_kwargs``.

    """

    precision_type = "fp16"

    def __init__(
        self,
        mode: Mode = "mixed",
        device: str | None = None,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        default_kwargs = GradScalerKwargs() if mode == "mixed" and scaler is None else None
        super().__init__(
            torch.float16,
            mode=mode,
            device=device,
            autocast_kwargs=autocast_kwargs,
            scaler_kwargs=scaler_kwargs or default_kwargs,
            scaler=scaler,
        )

    def check_device(self, device_type: str) -> None:
        """fp16 mixed precision needs a GPU.

        Raises:
            ValueError: On CPU, where torch's fp16 autocast gives no speed-up and Accelerate silently trains in fp32.

        """
        if self.mode == "mixed" and device_type == "cpu":
            raise ValueError(FP16_NEEDS_A_GPU)
