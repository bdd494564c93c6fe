"""How ``acc_*`` strategies adopt precision plugins: Lightning's string choices become this package's plugins."""

from __future__ import annotations

from typing import Any

from lightning_accel.precision import bind_device, from_lightning


def translating(base: Any) -> Any:
    """A precision property that stores :func:`~lightning_accel.precision.from_lightning` of what it is given.

    Lightning's connectors build their own plugin from ``precision="bf16-mixed"`` and assign it to the strategy;
    this property swaps it for the equivalent lightning_accel plugin (CPU-aware, Fabric-compatible) on the way in.
    """
    assert isinstance(base, property) and base.fget is not None and base.fset is not None
    getter, setter = base.fget, base.fset

    def set_translated(strategy: Any, plugin: Any) -> None:
        setter(strategy, None if plugin is None else from_lightning(plugin))

    return property(getter, set_translated, doc=base.__doc__)


def bind_precision(plugin: Any, devices: Any) -> None:
    """Tell the strategy's plugin which device type it runs on, once Lightning chose the devices."""
    if devices:
        bind_device(plugin, devices[0].type)
