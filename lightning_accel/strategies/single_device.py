"""``acc_no``: one process on one device (Accelerate's ``DistributedType.NO``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.strategies import SingleDeviceStrategy as _FabricSingleDeviceStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy as _TrainerSingleDeviceStrategy
from torch.nn import Module
from typing_extensions import override

from lightning_accel.config import TorchDynamoPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import get_root_device, lightning_private_members, set_root_device
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO
from lightning_accel.strategies.compile import apply_dynamo
from lightning_accel.strategies.precision_bridge import bind_precision, strategy_precision, translating
from lightning_accel.strategies.protocol import ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry


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


class _SingleDeviceAdapter:
    """What the Trainer and Fabric ``acc_no`` strategies share (listed before Lightning's strategy in the bases)."""

    distributed_type = DistributedType.NO
    parallel_devices: list[torch.device] | None

    def _adopt(self, strategy_name: str, dynamo_plugin: TorchDynamoPlugin | None, device_given: bool) -> None:
        """Keep the constructor's own arguments, once Lightning has parsed the device into ``_root_device``."""
        self._strategy_name = strategy_name
        self._dynamo_plugin = dynamo_plugin
        self._explicit_device: torch.device | None = get_root_device(self) if device_given else None
        # Lightning's connector fills this in with the devices it selected (see `_lazy_init_strategy`).
        self.parallel_devices = None

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
        accelerator: Passed to Lightning.
        checkpoint_io: Passed to Lightning.
        precision_plugin: Passed to Lightning.

    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        strategy_name: str = "acc_no",
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            device="cpu" if device is None else device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else NamingTorchCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self._adopt(strategy_name, dynamo_plugin, device is not None)

    precision_plugin = translating(_TrainerSingleDeviceStrategy.precision_plugin)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        self.model = self._compiled(self.model)
        super().setup(trainer)


@lightning_private_members("_configure_launcher")
class FabricAcceleratedSingleDeviceStrategy(_SingleDeviceAdapter, _FabricSingleDeviceStrategy, ShimStrategyDefaults):
    """Fabric twin of :class:`AcceleratedSingleDeviceStrategy` (``precision`` instead of ``precision_plugin``)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        strategy_name: str = "acc_no",
        accelerator: FabricAccelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: FabricPrecision | None = None,
    ) -> None:
        super().__init__(
            device="cpu" if device is None else device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else NamingTorchCheckpointIO(),
            precision=precision,
        )
        self._adopt(strategy_name, dynamo_plugin, device is not None)

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
