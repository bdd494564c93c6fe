"""Lightning accelerators for devices Lightning has none for (npu, xpu, hpu, mlu, musa, sdaa, neuron).

They use torch's generic device API (``torch.get_device_module``), so one small base class serves every vendor
extension that follows it. ``import lightning_accel`` registers each under its device name, in both the Trainer's and
Fabric's accelerator registries, unless that name is already taken (for example by a vendor's own Lightning plugin).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.pytorch.accelerators import Accelerator
from typing_extensions import override

from lightning_accel.config.devices import BACKEND_BY_DEVICE


class TorchDeviceAccelerator(Accelerator):
    """An accelerator for any device type torch exposes as ``torch.<device_type>``.

    Subclasses name their device with a class keyword: ``class NPUAccelerator(TorchDeviceAccelerator, device="npu")``.
    """

    device_type: ClassVar[str] = ""

    def __init_subclass__(cls, device: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.device_type = device

    @classmethod
    def _module(cls) -> Any:
        BACKEND_BY_DEVICE[cls.device_type].require_extension(f"accelerator={cls.device_type!r}")
        BACKEND_BY_DEVICE[cls.device_type].import_extension()
        return torch.get_device_module(cls.device_type)

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != self.device_type:
            raise ValueError(f"{type(self).__name__} runs on {self.device_type!r} devices, got {device}.")
        self._module().set_device(device)

    @override
    def teardown(self) -> None:
        pass

    @classmethod
    @override
    def parse_devices(cls, devices: int | str | list[int]) -> list[int]:
        """Turn ``devices`` (a count, ``"auto"``/``-1`` for all, or a list of indices) into device indices."""
        if isinstance(devices, list):
            return devices
        if isinstance(devices, str):
            devices = -1 if devices in ("auto", "-1") else int(devices)
        count = cls.auto_device_count() if devices == -1 else devices
        return list(range(count))

    @classmethod
    @override
    def get_parallel_devices(cls, devices: list[int]) -> list[torch.device]:
        return [torch.device(cls.device_type, i) for i in devices]

    @classmethod
    @override
    def auto_device_count(cls) -> int:
        return int(cls._module().device_count())

    @classmethod
    @override
    def is_available(cls) -> bool:
        if BACKEND_BY_DEVICE[cls.device_type].extension_missing():
            return False
        return bool(cls._module().is_available())

    @classmethod
    @override
    def name(cls) -> str:
        return cls.device_type

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        module = self._module()
        stats = getattr(module, "memory_stats", None)
        return dict(stats(device)) if callable(stats) else {}

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        if cls.device_type not in accelerator_registry:
            accelerator_registry.register(cls.device_type, cls, description=f"{cls.device_type} devices via torch")


class NPUAccelerator(TorchDeviceAccelerator, device="npu"):
    """Huawei Ascend NPUs (``torch_npu``)."""


class XPUAccelerator(TorchDeviceAccelerator, device="xpu"):
    """Intel GPUs (an XPU build of torch)."""


class HPUAccelerator(TorchDeviceAccelerator, device="hpu"):
    """Intel Gaudi HPUs (``habana_frameworks.torch``)."""


class MLUAccelerator(TorchDeviceAccelerator, device="mlu"):
    """Cambricon MLUs (``torch_mlu``)."""


class MUSAAccelerator(TorchDeviceAccelerator, device="musa"):
    """Moore Threads GPUs (``torch_musa``)."""


class SDAAAccelerator(TorchDeviceAccelerator, device="sdaa"):
    """Tecorigin SDAAs (``torch_sdaa``)."""


class NeuronAccelerator(TorchDeviceAccelerator, device="neuron"):
    """AWS Trainium/Inferentia NeuronCores (``torch_neuronx``)."""


DEVICE_ACCELERATORS: tuple[type[TorchDeviceAccelerator], ...] = (
    NPUAccelerator,
    XPUAccelerator,
    HPUAccelerator,
    MLUAccelerator,
    MUSAAccelerator,
    SDAAAccelerator,
    NeuronAccelerator,
)


def register_accelerators() -> None:
    """Register every device accelerator in the Trainer's and Fabric's registries (names already taken are kept)."""
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.pytorch.accelerators import AcceleratorRegistry

    for registry in (AcceleratorRegistry, ACCELERATOR_REGISTRY):
        for accelerator in DEVICE_ACCELERATORS:
            accelerator.register_accelerators(registry)
