"""Which device and collective backend each data-parallel :class:`DistributedType` runs on.

This table is the only place that knows that ``MULTI_NPU`` means ``npu`` devices talking over ``hccl`` and that those
need the ``torch_npu`` extension. Strategies, accelerators and (later) the config and launch code read it instead of
branching on the type.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from lightning_accel.enums import DistributedType


@dataclass(frozen=True)
class DeviceBackend:
    """How one data-parallel family maps onto torch.

    Attributes:
        distributed_type: The Accelerate distributed type this entry serves.
        device_type: The ``torch.device`` type the processes train on.
        collective_backend: The ``torch.distributed`` backend used between processes.
        extension: The module that adds the device (and its backend) to torch, or ``None`` if torch has it built in.
        install_hint: What to install when the extension (or a torch build with the device) is missing.

    """

    distributed_type: DistributedType
    device_type: str
    collective_backend: str
    extension: str | None = None
    install_hint: str = ""

    def extension_missing(self) -> bool:
        """Whether this machine lacks the software (not the hardware) needed for the device."""
        if self.extension is not None:
            return importlib.util.find_spec(self.extension.split(".")[0]) is None or (
                importlib.util.find_spec(self.extension) is None
            )
        if self.device_type == "xpu":
            return not torch.xpu._is_compiled()
        return False

    def require_extension(self, requested_by: str) -> None:
        """Raise a clear error when the device's torch extension is missing.

        Args:
            requested_by: The name shown to the user, such as ``"acc_multi_npu"``.

        Raises:
            ModuleNotFoundError: If the extension cannot be imported; the message says what to install.

        """
        if not self.extension_missing():
            return
        what = f"the `{self.extension}` package" if self.extension else f"a torch build with {self.device_type} support"
        raise ModuleNotFoundError(
            f"{requested_by} trains on {self.device_type!r} devices and needs {what}, which is not installed here."
            f" Install it: {self.install_hint}"
        )

    def import_extension(self) -> None:
        """Import the extension so that torch knows the device type and its collective backend."""
        if self.extension is not None:
            importlib.import_module(self.extension)


_CCL_MODULE = "oneccl_bindings_for_pytorch"

_BACKENDS: tuple[DeviceBackend, ...] = (
    DeviceBackend(DistributedType.MULTI_CPU, "cpu", "gloo"),
    DeviceBackend(DistributedType.MULTI_GPU, "cuda", "nccl"),
    DeviceBackend(
        DistributedType.MULTI_NPU, "npu", "hccl", "torch_npu", "pip install torch-npu (Huawei Ascend CANN required)"
    ),
    DeviceBackend(
        DistributedType.MULTI_XPU,
        "xpu",
        "xccl",
        None,
        "an XPU build of torch: pip install torch --index-url https://download.pytorch.org/whl/xpu",
    ),
    DeviceBackend(
        DistributedType.MULTI_HPU,
        "hpu",
        "hccl",
        "habana_frameworks.torch",
        "Intel Gaudi's PyTorch bridge (habana-torch-plugin, from the Gaudi software stack)",
    ),
    DeviceBackend(DistributedType.MULTI_MLU, "mlu", "cncl", "torch_mlu", "Cambricon's torch_mlu (Cambricon Neuware)"),
    DeviceBackend(DistributedType.MULTI_MUSA, "musa", "mccl", "torch_musa", "Moore Threads' torch_musa"),
    DeviceBackend(DistributedType.MULTI_SDAA, "sdaa", "tccl", "torch_sdaa", "Tecorigin's torch_sdaa"),
    DeviceBackend(
        DistributedType.MULTI_NEURON, "neuron", "neuron", "torch_neuronx", "pip install torch-neuronx (AWS Neuron SDK)"
    ),
)

BACKEND_BY_TYPE: dict[DistributedType, DeviceBackend] = {b.distributed_type: b for b in _BACKENDS}
BACKEND_BY_DEVICE: dict[str, DeviceBackend] = {b.device_type: b for b in _BACKENDS}


def backend_for_type(distributed_type: DistributedType) -> DeviceBackend:
    """The device entry of a data-parallel distributed type.

    Raises:
        ValueError: If ``distributed_type`` is not a data-parallel (DDP family) type.

    """
    try:
        return BACKEND_BY_TYPE[distributed_type]
    except KeyError:
        allowed = ", ".join(t.value for t in BACKEND_BY_TYPE)
        raise ValueError(
            f"DistributedType.{distributed_type.value} is not a data-parallel device type; the DDP family covers"
            f" {allowed}."
        ) from None


def backend_for_device(device_type: str) -> DeviceBackend:
    """The device entry for a ``torch.device`` type such as ``"cuda"``.

    Raises:
        ValueError: If no data-parallel strategy covers that device type.

    """
    try:
        return BACKEND_BY_DEVICE[device_type]
    except KeyError:
        allowed = ", ".join(BACKEND_BY_DEVICE)
        raise ValueError(
            f"No data-parallel strategy runs on {device_type!r} devices; supported device types: {allowed}."
        ) from None


def default_collective_backend(backend: DeviceBackend) -> str:
    """The collective backend to use by default: Intel's ``ccl`` on CPU when its bindings are installed."""
    if backend.device_type == "cpu" and importlib.util.find_spec(_CCL_MODULE) is not None:
        return "ccl"
    return backend.collective_backend


def import_collective_backend(name: str) -> None:
    """Import what registers a non-builtin collective backend with ``torch.distributed``."""
    if name == "ccl":
        importlib.import_module(_CCL_MODULE)
