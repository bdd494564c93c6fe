"""Accelerate's environment checks: which devices, dtypes and packages this machine has."""

from __future__ import annotations

import importlib.util
import operator
from collections.abc import Callable

import torch
from packaging.version import Version

__all__ = [
    "is_bf16_available",
    "is_mps_available",
    "is_npu_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_xpu_available",
]

_COMPARISONS: dict[str, Callable[[Version, Version], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    ">": operator.gt,
}


def is_torch_xla_available() -> bool:
    """Whether ``torch_xla`` is installed."""
    return importlib.util.find_spec("torch_xla") is not None


def is_mps_available() -> bool:
    """Whether Apple's MPS device can be used."""
    return bool(torch.backends.mps.is_available())


def is_xpu_available() -> bool:
    """Whether an Intel XPU is present (in a torch build with XPU support)."""
    return bool(torch.xpu.is_available())


def is_npu_available() -> bool:
    """Whether ``torch_npu`` is installed and sees an Ascend NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 can be used here: on CUDA when the GPU supports it, on CPU always.

    ``ignore_tpu`` is accepted for Accelerate's signature (there is no XLA support yet).
    """
    del ignore_tpu
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch with ``version``: ``is_torch_version(">=", "2.4")``.

    Raises:
        ValueError: For an unknown comparison.

    """
    if operation not in _COMPARISONS:
        raise ValueError(f"Unknown comparison {operation!r}; use one of {', '.join(_COMPARISONS)}.")
    return _COMPARISONS[operation](Version(Version(torch.__version__).base_version), Version(version))
