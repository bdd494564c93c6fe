"""How ``acc_*`` strategies adopt precision plugins: Lightning's string choices become this package's plugins."""

from __future__ import annotations

from typing import Any

from lightning_accel.precision import AcceleratePrecision, FP8Precision, bind_device, from_lightning
from lightning_accel.strategies.deepspeed_fp8 import fp8_deepspeed_precision, unwrap_fp8


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


def strategy_precision(strategy: Any) -> Any:
    """The precision plugin of a Trainer strategy (its ``precision_plugin``) or of a Fabric one (its ``precision``)."""
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    return strategy.precision_plugin if isinstance(strategy, TrainerStrategy) else strategy.precision


def bind_precision(plugin: Any, devices: Any) -> None:
    """Tell the strategy's plugin which device type it runs on, once Lightning chose the devices.

    Under DeepSpeed the plugin is the fp8 precision's DeepSpeed form; the ``FP8Precision`` inside it is bound (so fp8
    on a CPU or an older GPU is refused there too).
    """
    if devices:
        bind_device(unwrap_fp8(plugin), devices[0].type)


def deepspeed_translating(base: Any, deepspeed_precision: type) -> Any:
    """A precision property for DeepSpeed strategies: this package's plugins become DeepSpeed's own precision.

    Under DeepSpeed the engine owns precision (its ``fp16``/``bf16`` config sections, its loss scaler and its
    backward), so a ``BF16Precision`` given as ``plugins=[...]`` means DeepSpeed's ``"bf16-mixed"``, and so on. An
    ``FP8Precision`` becomes DeepSpeed's ``"bf16-mixed"`` plus its float8 Linear conversion, as in Accelerate (see
    :mod:`lightning_accel.strategies.deepspeed_fp8`).
    """
    assert isinstance(base, property) and base.fget is not None and base.fset is not None
    getter, setter = base.fget, base.fset

    def set_translated(strategy: Any, plugin: Any) -> None:
        setter(strategy, None if plugin is None else _as_deepspeed(plugin, deepspeed_precision))

    return property(getter, set_translated, doc=base.__doc__)


def _as_deepspeed(plugin: Any, deepspeed_precision: type) -> Any:
    if not isinstance(plugin, AcceleratePrecision):
        return plugin
    if isinstance(plugin, FP8Precision):
        return fp8_deepspeed_precision(plugin, deepspeed_precision)
    return deepspeed_precision(plugin.precision)
