"""``acc_xla``: Accelerate's ``DistributedType.XLA`` on ``torch_xla``, for the Trainer and Fabric.

Both classes are Lightning's ``SingleDeviceXLAStrategy`` (one XLA device per process, ``MpDeviceLoader`` data
loading, ``xm.optimizer_step`` through Lightning's ``XLAPrecision``), with Accelerate's name and type on top and an
accelerator that counts the devices of whichever PJRT runtime ``PJRT_DEVICE`` names: Lightning's own
``XLAAccelerator`` counts TPU chips only, so with ``PJRT_DEVICE=CPU`` (``CPU_NUM_DEVICES`` devices, 1 by default)
it would find none. ``torch_xla`` is imported only when a strategy is built; without it the error names
``pip install torch-xla``.

By name: Lightning resolves a strategy name after choosing the accelerator, and ``"auto"`` picks ``CPUAccelerator``
where there are no TPU chips. ``Trainer(strategy="acc_xla")`` on ``PJRT_DEVICE=CPU`` (torch_xla's own default, with a
warning, where it finds no TPU) keeps the strategy's PJRT accelerator (the Trainer reads the strategy's);
``Fabric(strategy="acc_xla")`` raises with the fix (``accelerator=FabricPJRTAccelerator()``), since Fabric keeps the
connector's accelerator for itself. A Trainer whose ``devices`` give it more than one device raises at ``fit``.

One process only. Several replicas on CPU do not work in torch-xla 2.9.0, whose CPU client is built for one process
(``xla::GetPjRtCpuClient(async, CPU_NUM_DEVICES)``: no distributed key-value store, no cross-process collectives):

- ``xmp.spawn`` with ``CPU_NUM_DEVICES=2`` starts 2 processes that each hold a 2-device client and drive one of its
  devices, so the first ``xm.all_reduce`` waits for a local participant that never comes: XLA's rendezvous prints
  "Expected 2 threads to join the rendezvous, but not all of them arrived on time" and aborts after 10 seconds
  ("Termination timeout for `all reduce RendezvousKey{... num_local_participants=2 ...}`").
- ``torchrun`` with one device per process: ``xr.world_size()`` is 1 in each, ``init_process_group("xla",
  init_method="xla://")`` makes each process rank 0 of 1, and with ``env://`` (ranks 0 and 1 of 2) an ``all_reduce``
  of ``rank + 1`` returns 1 and 2 instead of 3: each process trains alone, silently. :func:`refuse_cpu_processes`
  turns that into an error.

Lightning's multi-device ``XLAStrategy`` (TPU hosts and pods) is therefore untested and not offered as ``acc_xla``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from lightning.fabric.accelerators import Accelerator as _FabricAccelerator
from lightning.fabric.accelerators import XLAAccelerator as _FabricXLAAccelerator
from lightning.fabric.strategies import SingleDeviceXLAStrategy as _FabricXLAStrategy
from lightning.pytorch.accelerators import Accelerator as _TrainerAccelerator
from lightning.pytorch.accelerators import CPUAccelerator as _TrainerCPUAccelerator
from lightning.pytorch.accelerators import XLAAccelerator as _TrainerXLAAccelerator
from lightning.pytorch.strategies import SingleDeviceXLAStrategy as _TrainerXLAStrategy
from typing_extensions import override

from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import get_accelerator_connector, get_parallel_devices, get_trainer
from lightning_accel.strategies.protocol import ProcessGroupShards, ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry

__all__ = [
    "AcceleratedXLAStrategy",
    "FabricAcceleratedXLAStrategy",
    "FabricPJRTAccelerator",
    "PJRTAccelerator",
    "refuse_cpu_processes",
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


def refuse_cpu_processes() -> None:
    """Refuse several processes on PJRT's CPU runtime, where they would train apart without a word.

    torch-xla 2.9.0 builds its CPU client for one process (no distributed key-value store, no cross-process
    collectives): under ``torchrun`` every process is rank 0 of a world of 1 (``xla://``), and an ``all_reduce`` on
    an ``env://`` process group returns each process's own value.

    Raises:
        ValueError: If ``PJRT_DEVICE=CPU`` and ``WORLD_SIZE`` (set by ``torchrun``) is above 1.

    """
    world_size = os.environ.get("WORLD_SIZE", "1")
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU" and world_size.isdigit() and int(world_size) > 1:
        raise ValueError(
            f"acc_xla on PJRT_DEVICE=CPU runs one process, but WORLD_SIZE={world_size}: torch-xla's CPU runtime has "
            "no cross-process collectives, so each process would train alone. Launch one process, or use acc_multi_cpu "
            "(gloo) for several CPU processes"
        )


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


def _trainer_accelerator(accelerator: Any, own: Any) -> Any:
    """The accelerator the Trainer strategy keeps when Lightning's connector assigns ``accelerator``.

    A strategy *name* is resolved after the connector has chosen the accelerator, and ``"auto"`` picks Lightning's
    ``CPUAccelerator`` where there are no TPU chips; it cannot place tensors on an XLA device. With
    ``PJRT_DEVICE=CPU`` that choice (or ``accelerator="cpu"``) means PJRT's CPU runtime, so the strategy keeps its
    own PJRT accelerator ``own`` (a new one when it has none). The Trainer reads the strategy's accelerator only.

    Raises:
        ValueError: If ``accelerator`` cannot drive an XLA device.

    """
    if accelerator is None or isinstance(accelerator, _TrainerXLAAccelerator):
        return accelerator
    if isinstance(accelerator, _TrainerCPUAccelerator) and os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return own if isinstance(own, _TrainerXLAAccelerator) else PJRTAccelerator()
    raise ValueError(
        f"acc_xla runs on an XLA device, not on Lightning's {type(accelerator).__name__}: set PJRT_DEVICE=CPU to "
        "run XLA on CPU (PJRT_DEVICE=TPU on a TPU VM) and leave `accelerator` unset, or pass "
        "`Trainer(strategy='acc_xla', accelerator=PJRTAccelerator())` (from lightning_accel.strategies.xla)"
    )


def _fabric_accelerator(accelerator: Any) -> Any:
    """The accelerator the Fabric strategy takes from Lightning's connector: an XLA one, or an error with the fix.

    Fabric keeps the connector's accelerator for itself (``fabric.accelerator``, ``fabric.to_device``), so unlike the
    Trainer's, the strategy cannot swap Lightning's ``CPUAccelerator`` (the ``"auto"`` choice for a strategy name
    without TPU chips) for a PJRT one: it refuses it instead of running half on each.

    Raises:
        ValueError: If ``accelerator`` cannot drive an XLA device.

    """
    if accelerator is None or isinstance(accelerator, _FabricXLAAccelerator):
        return accelerator
    raise ValueError(
        f"Fabric chose Lightning's {type(accelerator).__name__} for strategy='acc_xla', which cannot drive an XLA "
        "device (a strategy name is resolved after the accelerator, and 'auto' finds no TPU chips): pass "
        "`Fabric(strategy='acc_xla', accelerator=FabricPJRTAccelerator())` (from lightning_accel.strategies.xla) "
        "or `Fabric(strategy=strategy_for('XLA', fabric=True))`, with PJRT_DEVICE=CPU to run XLA on CPU"
    )


def _check_one_device(count: int) -> None:
    """``acc_xla`` drives one device: refuse a Trainer whose ``devices`` gave it more (it would use the first)."""
    if count != 1:
        raise ValueError(
            f"acc_xla runs one XLA device per process, but the Trainer's devices gave it {count}: pass devices=1"
        )


class _PJRTDevices:
    """Device counting of any PJRT runtime (TPU, or CPU), shared by the Trainer and Fabric XLA accelerators.

    ``_lightning_count`` is Lightning's own (TPU) counter, asked first.
    """

    _lightning_count: ClassVar[Callable[[], int]]

    @classmethod
    def auto_device_count(cls) -> int:
        """The PJRT runtime's device count."""
        require_torch_xla()
        return _pjrt_device_count(cls._lightning_count)

    @classmethod
    def is_available(cls) -> bool:
        """Whether torch_xla is installed and its runtime has a device."""
        return importlib.util.find_spec("torch_xla") is not None and cls.auto_device_count() > 0

    @classmethod
    def parse_devices(cls, devices: int | str | list[int]) -> int | list[int]:
        """``devices`` checked against the runtime's device count."""
        return _parse_pjrt_devices(devices, cls.auto_device_count())

    @classmethod
    def get_parallel_devices(cls, devices: int | list[int]) -> list[torch.device]:
        """The XLA devices ``devices`` names."""
        return _xla_devices(cls.parse_devices(devices))


class PJRTAccelerator(_PJRTDevices, _TrainerXLAAccelerator):  # type: ignore[misc]  # classmethods for staticmethods
    """Lightning's Trainer ``XLAAccelerator``, counting the devices of any PJRT runtime (TPU, or CPU)."""

    _lightning_count = staticmethod(_TrainerXLAAccelerator.auto_device_count)


class FabricPJRTAccelerator(_PJRTDevices, _FabricXLAAccelerator):  # type: ignore[misc]  # as PJRTAccelerator
    """Fabric twin of :class:`PJRTAccelerator`."""

    _lightning_count = staticmethod(_FabricXLAAccelerator.auto_device_count)


class _PJRTStrategy:
    """What the Trainer and Fabric XLA strategies share (listed before Lightning's ``SingleDeviceXLAStrategy``).

    ``_default_accelerator`` is the PJRT accelerator of the strategy's side (Trainer or Fabric).
    """

    _default_accelerator: ClassVar[type[_FabricXLAAccelerator | _TrainerXLAAccelerator]]
    accelerator: Any
    strategy_name: str

    def __init__(self, device: Any = "xla:0", *, strategy_name: str = "acc_xla", **kwargs: Any) -> None:
        require_torch_xla()
        kwargs.setdefault("accelerator", self._default_accelerator())
        super().__init__(torch.device(device), **kwargs)  # type: ignore[call-arg]  # Lightning's, after this class
        refuse_cpu_processes()  # after torch_xla has started: without a TPU it sets PJRT_DEVICE=CPU itself
        self.accelerator = self.accelerator  # the check the connector's assignment gets
        self.strategy_name = strategy_name

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's type: ``XLA``."""
        return DistributedType.XLA


class AcceleratedXLAStrategy(_PJRTStrategy, _TrainerXLAStrategy):
    """Trainer strategy for ``DistributedType.XLA``: Lightning's ``SingleDeviceXLAStrategy`` on a PJRT accelerator.

    Args:
        device: The XLA device (``"xla:0"``).
        strategy_name: The name shown in messages (set by the registry).
        **kwargs: ``SingleDeviceXLAStrategy``'s arguments (``debug``, ``checkpoint_io``, ...); ``accelerator``
            defaults to :class:`PJRTAccelerator`.

    Raises:
        ModuleNotFoundError: If ``torch_xla`` is not installed (the message names ``pip install torch-xla``).
        ValueError: For an accelerator that cannot drive an XLA device, several processes on PJRT's CPU runtime, or
            (at ``fit``) a Trainer whose ``devices`` give it more than one device.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(strategy="acc_xla", devices=1)  # doctest: +SKIP  (PJRT_DEVICE=CPU or TPU)

    """

    _default_accelerator = PJRTAccelerator

    @property
    @override
    def accelerator(self) -> _TrainerAccelerator | None:
        return _TrainerXLAStrategy.accelerator.fget(self)  # type: ignore[attr-defined]

    @accelerator.setter
    @override
    def accelerator(self, accelerator: _TrainerAccelerator | None) -> None:
        own = self.accelerator
        _TrainerXLAStrategy.accelerator.fset(self, _trainer_accelerator(accelerator, own))  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        trainer = None if module is None else get_trainer(module)
        if trainer is not None:  # the connector's devices; a single-device strategy reports one whatever was asked
            connector = get_accelerator_connector(trainer)
            _check_one_device(len(get_parallel_devices(connector)))
        super().setup_environment()


class FabricAcceleratedXLAStrategy(ProcessGroupShards, _PJRTStrategy, _FabricXLAStrategy, ShimStrategyDefaults):
    """Fabric strategy for ``DistributedType.XLA``: Lightning's Fabric ``SingleDeviceXLAStrategy`` on PJRT.

    Args:
        device: The XLA device (``"xla:0"``).
        strategy_name: The name shown in messages (set by the registry).
        **kwargs: ``SingleDeviceXLAStrategy``'s arguments; ``accelerator`` defaults to :class:`FabricPJRTAccelerator`.

    Raises:
        ModuleNotFoundError: If ``torch_xla`` is not installed (the message names ``pip install torch-xla``).
        ValueError: For an accelerator that cannot drive an XLA device (Lightning's ``CPUAccelerator``, which
            ``Fabric(strategy="acc_xla")`` picks without ``accelerator=``), or several processes on PJRT's CPU runtime.

    """

    _default_accelerator = FabricPJRTAccelerator

    @property
    @override
    def accelerator(self) -> _FabricAccelerator | None:
        return _FabricXLAStrategy.accelerator.fget(self)  # type: ignore[attr-defined]

    @accelerator.setter
    @override
    def accelerator(self, accelerator: _FabricAccelerator | None) -> None:
        _FabricXLAStrategy.accelerator.fset(self, _fabric_accelerator(accelerator))  # type: ignore[attr-defined]


ENTRIES = (
    StrategyEntry(
        "acc_xla",
        AcceleratedXLAStrategy,
        FabricAcceleratedXLAStrategy,
        "Accelerate's XLA type on torch_xla (one TPU, or CPU with PJRT_DEVICE=CPU), on SingleDeviceXLAStrategy",
        DistributedType.XLA,
    ),
)
