"""``acc_no``: one process on one device (Accelerate's ``DistributedType.NO``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import SingleDeviceStrategy as _FabricSingleDeviceStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy as _TrainerSingleDeviceStrategy
from torch.nn import Module
from typing_extensions import Unpack, override

from lightning_accel.config import TorchDynamoPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import lightning_private_members, set_root_device
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO
from lightning_accel.strategies.compile import apply_dynamo
from lightning_accel.strategies.lightning_arguments import FabricPlugins, TrainerPlugins, check_keywords
from lightning_accel.strategies.precision_adoption import bind_precision, strategy_precision, translating
from lightning_accel.strategies.protocol import ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.utils.memory import DeviceLike


def _pick_device(
    strategy_name: str, explicit: torch.device | None, devices: Sequence[torch.device] | None
) -> torch.device:
    """The device to train on: the one passed explicitly, else the single device Lightning selected."""
    if explicit is not None:
        return explicit
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        raise ValueError(
            f"Strategy {strategy_name!r} trains one process on one device, but {len(devices)} devices were requested"
            f" ({', '.join(str(d) for d in devices)}). Pass `devices=1`, or use `strategy='acc_ddp'` for one process"
            " per device."
        )
    return devices[0]


class SingleDeviceOptions(TypedDict, total=False):
    """``acc_no``'s settings besides ``device`` (documented on :class:`AcceleratedSingleDeviceStrategy`)."""

    dynamo_plugin: TorchDynamoPlugin | None
    strategy_name: str
    checkpoint_io: CheckpointIO | None


class TrainerSingleDeviceArgs(SingleDeviceOptions, TrainerPlugins, total=False):
    """The keyword arguments of :class:`AcceleratedSingleDeviceStrategy`."""


class FabricSingleDeviceArgs(SingleDeviceOptions, FabricPlugins, total=False):
    """The keyword arguments of :class:`FabricAcceleratedSingleDeviceStrategy`."""


class _SingleDeviceAdapter:
    """What the Trainer and Fabric ``acc_no`` strategies share (listed before Lightning's strategy in the bases)."""

    distributed_type = DistributedType.NO
    parallel_devices: list[torch.device] | None

    def _adopt(self, device: DeviceLike | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """Keep the constructor's own arguments; the arguments for Lightning's ``SingleDeviceStrategy``."""
        check_keywords(self, options)
        self._strategy_name = options.get("strategy_name") or "acc_no"
        self._dynamo_plugin = options.get("dynamo_plugin")
        self._explicit_device: torch.device | None = None if device is None else torch.device(device)
        # Lightning's connector fills this in with the devices it selected (see `_lazy_init_strategy`).
        self.parallel_devices = None
        lightning = {key: value for key, value in options.items() if key not in ("strategy_name", "dynamo_plugin")}
        if lightning.get("checkpoint_io") is None:
            lightning["checkpoint_io"] = NamingTorchCheckpointIO()
        return {**lightning, "device": "cpu" if device is None else device}

    def _configure_launcher(self) -> None:
        """Settle the device (the explicit one, else Lightning's single pick) and bind the precision to it."""
        device = _pick_device(self._strategy_name, self._explicit_device, self.parallel_devices)
        set_root_device(self, device)
        bind_precision(strategy_precision(self), [device])
        super()._configure_launcher()  # type: ignore[misc]  # Lightning's, after this class in the MRO

    def _compiled(self, module: Module) -> Module:
        """``module``, compiled in place as the dynamo plugin says."""
        return apply_dynamo(module, self._dynamo_plugin)


@lightning_private_members("_configure_launcher")
class AcceleratedSingleDeviceStrategy(_SingleDeviceAdapter, _TrainerSingleDeviceStrategy):
    """Trainer strategy for one process on one device: cpu, cuda, mps or whichever device the accelerator gives.

    Args:
        device: The device to use. ``None`` takes the device the Trainer's ``accelerator``/``devices`` select.
        dynamo_plugin: ``torch.compile`` settings applied to the model at setup.
        strategy_name: The name shown in messages (set by the registry).
        checkpoint_io: Lightning's checkpoint I/O; by default ``torch.save`` files, an unreadable one named in the
            error.
        **kwargs: The keyword settings above, and Lightning's ``accelerator`` and ``precision_plugin`` (the Trainer sets
            them when left out).

    """

    def __init__(self, device: DeviceLike | None = None, **kwargs: Unpack[TrainerSingleDeviceArgs]) -> None:
        super().__init__(**self._adopt(device, kwargs))

    precision_plugin = translating(_TrainerSingleDeviceStrategy.precision_plugin)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        self.model = self._compiled(self.model)
        super().setup(trainer)


@lightning_private_members("_configure_launcher")
class FabricAcceleratedSingleDeviceStrategy(_SingleDeviceAdapter, _FabricSingleDeviceStrategy, ShimStrategyDefaults):
    """Fabric twin of :class:`AcceleratedSingleDeviceStrategy` (``precision`` instead of ``precision_plugin``)."""

    def __init__(self, device: DeviceLike | None = None, **kwargs: Unpack[FabricSingleDeviceArgs]) -> None:
        super().__init__(**self._adopt(device, kwargs))

    precision = translating(_FabricSingleDeviceStrategy.precision)

    @override
    def setup_module(self, module: Module) -> Module:
        return super().setup_module(self._compiled(module))


ENTRIES = (
    StrategyEntry(
        "acc_no",
        AcceleratedSingleDeviceStrategy,
        FabricAcceleratedSingleDeviceStrategy,
        "One process on one device (cpu, cuda, mps, ...) (NO)",
        DistributedType.NO,
    ),
)
