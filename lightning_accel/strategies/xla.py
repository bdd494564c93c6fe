"""``acc_xla``: Accelerate's ``DistributedType.XLA`` on ``torch_xla``, for the Trainer and Fabric.

Both classes are Lightning's ``SingleDeviceXLAStrategy`` (one XLA device per process, ``MpDeviceLoader`` data
loading, ``xm.optimizer_step`` through Lightning's ``XLAPrecision``), with Accelerate's name and type on top and an
accelerator that counts the devices of whichever PJRT runtime ``PJRT_DEVICE`` names: Lightning's own
``XLAAccelerator`` counts TPU chips only, so with ``PJRT_DEVICE=CPU`` (``CPU_NUM_DEVICES`` devices, 1 by default)
it would find none. ``torch_xla`` is imported only when a strategy is built; without it the error names
``pip install torch-xla``. Several replicas (Lightning's ``XLAStrategy`` over ``xmp.spawn``, TPU pods) are not part
of ``acc_xla`` yet: PJRT's CPU runtime runs one process, and its threaded multi-device mode hangs in torch-xla 2.9.0's
first all-reduce, so there is nothing here to test them on.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from lightning.fabric.accelerators import XLAAccelerator as _FabricXLAAccelerator
from lightning.fabric.strategies import SingleDeviceXLAStrategy as _FabricXLAStrategy
from lightning.pytorch.accelerators import XLAAccelerator as _TrainerXLAAccelerator
from lightning.pytorch.strategies import SingleDeviceXLAStrategy as _TrainerXLAStrategy
from typing_extensions import override

from lightning_accel.enums import DistributedType
from lightning_accel.strategies.registry import StrategyEntry

__all__ = [
    "AcceleratedXLAStrategy",
    "FabricAcceleratedXLAStrategy",
    "FabricPJRTAccelerator",
    "PJRTAccelerator",
    "require_torch_xla",
]

_INSTALL = (
    "acc_xla needs torch_xla: `pip install torch-xla` (the release matching your torch, e.g. torch-xla==2.9.0 with "
    "torch==2.9.0); set PJRT_DEVICE=CPU to run it on CPU, PJRT_DEVICE=TPU on TPU VMs"
)


def require_torch_xla() -> None:
    """Raise the install hint when ``torch_xla`` is missing (without importing it).

    Raises:
        ModuleNotFoundError: If ``torch_xla`` is not installed.

    """
    if importlib.util.find_spec("torch_xla") is None:
        raise ModuleNotFoundError(_INSTALL)


def _pjrt_device_count(tpu_count: Any) -> int:
    """Devices of the PJRT runtime ``PJRT_DEVICE`` names, read from the environment (the runtime stays unstarted).

    ``xmp.spawn`` refuses to start once the runtime is up in the launching process, so nothing here touches it.
    """
    device = os.environ.get("PJRT_DEVICE", "").upper()
    if device in ("", "TPU"):
        return int(tpu_count())
    count = os.environ.get(f"{device}_NUM_DEVICES", "1")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{device}_NUM_DEVICES must be a positive integer, got {count!r}")
    return int(count)


def _parse_pjrt_devices(devices: Any, count: int) -> int | list[int]:
    """``devices`` checked against the runtime's ``count`` (Lightning's own check asks the TPU chips)."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and 1 <= devices <= count:
        return devices
    one = isinstance(devices, (list, tuple)) and len(devices) == 1 and isinstance(devices[0], int)
    if one and 0 <= devices[0] < count:
        return [devices[0]]
    raise ValueError(
        f"devices={devices!r} does not fit the {count} PJRT device(s) of PJRT_DEVICE="
        f"{os.environ.get('PJRT_DEVICE', 'TPU')!r}: pass a number from 1 to {count} or one index in a list "
        "(set CPU_NUM_DEVICES for more CPU devices)"
    )


def _xla_devices(devices: int | list[int]) -> list[torch.device]:
    if isinstance(devices, int):
        return [torch.device("xla", index) for index in range(devices)]
    return [torch.device("xla", devices[0])]


class PJRTAccelerator(_TrainerXLAAccelerator):
    """Lightning's Trainer ``XLAAccelerator``, counting the devices of any PJRT runtime (TPU, or CPU)."""

    @staticmethod
    @override
    def auto_device_count() -> int:  # type: ignore[override]  # Lightning caches its own (lru_cache)
        require_torch_xla()
        return _pjrt_device_count(_TrainerXLAAccelerator.auto_device_count)

    @staticmethod
    @override
    def is_available() -> bool:  # type: ignore[override]  # Lightning caches its own (lru_cache)
        return importlib.util.find_spec("torch_xla") is not None and PJRTAccelerator.auto_device_count() > 0

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> int | list[int]:
        return _parse_pjrt_devices(devices, PJRTAccelerator.auto_device_count())

    @staticmethod
    @override
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        return _xla_devices(_parse_pjrt_devices(devices, PJRTAccelerator.auto_device_count()))


class FabricPJRTAccelerator(_FabricXLAAccelerator):
    """Fabric twin of :class:`PJRTAccelerator`."""

    @staticmethod
    @override
    def auto_device_count() -> int:  # type: ignore[override]  # Lightning caches its own (lru_cache)
        require_torch_xla()
        return _pjrt_device_count(_FabricXLAAccelerator.auto_device_count)

    @staticmethod
    @override
    def is_available() -> bool:  # type: ignore[override]  # Lightning caches its own (lru_cache)
        return importlib.util.find_spec("torch_xla") is not None and FabricPJRTAccelerator.auto_device_count() > 0

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> int | list[int]:
        return _parse_pjrt_devices(devices, FabricPJRTAccelerator.auto_device_count())

    @staticmethod
    @override
    def get_parallel_devices(devices: int | list[int]) -> list[torch.device]:
        return _xla_devices(_parse_pjrt_devices(devices, FabricPJRTAccelerator.auto_device_count()))


class AcceleratedXLAStrategy(_TrainerXLAStrategy):
    """Trainer strategy for ``DistributedType.XLA``: Lightning's ``SingleDeviceXLAStrategy`` on a PJRT accelerator.

    Args:
        device: The XLA device (``"xla:0"``).
        strategy_name: The name shown in messages (set by the registry).
        **kwargs: ``SingleDeviceXLAStrategy``'s arguments (``debug``, ``checkpoint_io``, ...); ``accelerator``
            defaults to :class:`PJRTAccelerator`.

    Raises:
        ModuleNotFoundError: If ``torch_xla`` is not installed (the message names ``pip install torch-xla``).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(strategy="acc_xla", devices=1)  # doctest: +SKIP  (PJRT_DEVICE=CPU or TPU)

    """

    def __init__(self, device: Any = "xla:0", *, strategy_name: str = "acc_xla", **kwargs: Any) -> None:
        require_torch_xla()
        kwargs.setdefault("accelerator", PJRTAccelerator())
        super().__init__(torch.device(device), **kwargs)
        self.strategy_name = strategy_name

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's type: ``XLA``."""
        return DistributedType.XLA


class FabricAcceleratedXLAStrategy(_FabricXLAStrategy):
    """Fabric strategy for ``DistributedType.XLA``: Lightning's Fabric ``SingleDeviceXLAStrategy`` on PJRT.

    Args:
        device: The XLA device (``"xla:0"``).
        strategy_name: The name shown in messages (set by the registry).
        **kwargs: ``SingleDeviceXLAStrategy``'s arguments; ``accelerator`` defaults to :class:`FabricPJRTAccelerator`.

    Raises:
        ModuleNotFoundError: If ``torch_xla`` is not installed (the message names ``pip install torch-xla``).

    """

    def __init__(self, device: Any = "xla:0", *, strategy_name: str = "acc_xla", **kwargs: Any) -> None:
        require_torch_xla()
        kwargs.setdefault("accelerator", FabricPJRTAccelerator())
        super().__init__(torch.device(device), **kwargs)
        self.strategy_name = strategy_name

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's type: ``XLA``."""
        return DistributedType.XLA


ENTRIES = (
    StrategyEntry(
        "acc_xla",
        AcceleratedXLAStrategy,
        FabricAcceleratedXLAStrategy,
        "Accelerate's XLA type on torch_xla (one TPU, or CPU with PJRT_DEVICE=CPU), on SingleDeviceXLAStrategy",
        DistributedType.XLA,
    ),
)
