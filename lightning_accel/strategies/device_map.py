"""``acc_device_map``: inference on one process with a model dispatched by a device map (big-model inference).

A model loaded with :func:`~lightning_accel.load_checkpoint_and_dispatch` (or :func:`~lightning_accel.dispatch_model`,
:func:`~lightning_accel.cpu_offload`, :func:`~lightning_accel.disk_offload`) is already placed: its blocks sit on the
devices of the map, and its offloaded weights are on the meta device, loaded by hooks for each call. Lightning's
single-device strategies move the whole module to the root device at setup and back to the CPU at teardown, which
fails on those meta weights (and would undo a map over several devices). This strategy moves only what no map placed
(the LightningModule's own tensors, metrics, ...), and refuses training a dispatched model with the message of
Accelerate's ``verify_device_map`` check: offloaded weights are reloaded on every call, so updates would be lost.

Use it with ``configure_model`` (Trainer) or ``Fabric.init_module(empty_init=True)``::

    class BigModelInference(L.LightningModule):
        def configure_model(self):
            with init_empty_weights():
                self.model = MyModel(config)  # meta parameters: no memory
            self.model = load_checkpoint_and_dispatch(self.model, "ckpt/", device_map="auto", offload_folder="off/")

    trainer = L.Trainer(strategy="acc_device_map", devices=1)
    predictions = trainer.predict(BigModelInference(), dataloader)

The root device (``devices=1`` of the accelerator) is where batches go; the hooks move each block's inputs on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.strategies.single_device import (
    AcceleratedSingleDeviceStrategy,
    FabricAcceleratedSingleDeviceStrategy,
)
from lightning_accel.utils.modeling import has_offloaded_params, verify_device_map

__all__ = ["DeviceMapStrategy", "FabricDeviceMapStrategy", "refuse_training_dispatched"]


def _undispatched(module: Module) -> Iterator[Module]:
    """``module`` and its submodules, leaving out every module a device map placed (and all below it)."""
    if hasattr(module, "hf_device_map"):
        return
    yield module
    for child in module.children():
        yield from _undispatched(child)


def move_undispatched(module: Module, device: torch.device) -> None:
    """Move the tensors of ``module`` that no device map placed to ``device``; dispatched parts stay as mapped."""
    for part in _undispatched(module):
        part._apply(lambda tensor: tensor.to(device), recurse=False)


def _mapped_devices(model: Module) -> list[str]:
    devices = {str(d) for m in model.modules() for d in (getattr(m, "hf_device_map", None) or {}).values()}
    return sorted(devices) or ["offloaded weights"]


def refuse_training_dispatched(model: Module) -> None:
    """Refuse training ``model`` when it is dispatched or offloaded.

    That is when :func:`~lightning_accel.utils.verify_device_map` finds a map of several entries (Accelerate's
    check), and also when a module's weights are offloaded (a map of one ``"disk"`` entry, :func:`cpu_offload`),
    which Accelerate's check lets through although the updates would be lost there as well.

    Raises:
        ValueError: Naming the devices of the map and what to do instead.

    """
    if verify_device_map(model) or any(has_offloaded_params(module) for module in model.modules()):
        raise ValueError(
            "You can't train a model that has been loaded with `device_map='auto'`: "
            f"{type(model).__name__} was dispatched over {_mapped_devices(model)}, and offloaded weights are read "
            "again on every call, so optimizer updates would be lost. Use strategy 'acc_device_map' for "
            "predict/validate/test only; to train, load the model without a device map (strategy='acc_fsdp' "
            "shards one that does not fit on a device)."
        )


class DeviceMapStrategy(AcceleratedSingleDeviceStrategy):
    """Trainer strategy for inference with a dispatched model (see the module docstring).

    Takes :class:`~lightning_accel.strategies.AcceleratedSingleDeviceStrategy`'s arguments; the device is where
    batches go (the map's main device).
    """

    def __init__(self, *args: Any, strategy_name: str = "acc_device_map", **kwargs: Any) -> None:
        super().__init__(*args, strategy_name=strategy_name, **kwargs)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_training_dispatched(self.model)
        super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_undispatched(self.model, self.root_device)

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the whole module to the CPU, which meta (offloaded) weights cannot follow.
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            move_undispatched(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


class FabricDeviceMapStrategy(FabricAcceleratedSingleDeviceStrategy):
    """Fabric twin of :class:`DeviceMapStrategy`: ``setup_module`` keeps the map; an optimizer for it is refused."""

    def __init__(self, *args: Any, strategy_name: str = "acc_device_map", **kwargs: Any) -> None:
        super().__init__(*args, strategy_name=strategy_name, **kwargs)
        self._dispatched: list[Module] = []

    @override
    def setup_module(self, module: Module) -> Module:
        if verify_device_map(module) or any(has_offloaded_params(part) for part in module.modules()):
            self._dispatched.append(module)
        return super().setup_module(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self._dispatched:
            if any(id(p) in owned for p in module.parameters()):
                refuse_training_dispatched(module)
        return super().setup_optimizer(optimizer)

    @override
    def module_to_device(self, module: Module) -> None:
        move_undispatched(module, self.root_device)


ENTRIES = (
    StrategyEntry(
        "acc_device_map",
        DeviceMapStrategy,
        FabricDeviceMapStrategy,
        "Inference with a model dispatched by a device map (big-model inference; training refused)",
    ),
)
