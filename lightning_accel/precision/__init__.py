"""A Lightning precision plugin for every Accelerate ``PrecisionType``: ``no``, ``fp16``, ``bf16`` and ``fp8``.

Each plugin derives from ``lightning.pytorch.plugins.Precision`` and accepts Fabric's call shapes too, so the same
object works in ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``. ``acc_*`` strategies also translate
Lightning's precision strings (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``, ``"bf16-true"``, ``"16-true"``) into
these plugins (see :func:`from_lightning`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_accel.enums import PrecisionType
from lightning_accel.precision.base import AcceleratePrecision
from lightning_accel.precision.fp8 import FP8Precision
from lightning_accel.precision.plugins import BF16Precision, FP16Precision, FP32Precision

if TYPE_CHECKING:
    from lightning.fabric.plugins import Precision as LightningPrecision

_BY_TYPE: dict[PrecisionType, type[AcceleratePrecision]] = {
    PrecisionType.NO: FP32Precision,
    PrecisionType.FP16: FP16Precision,
    PrecisionType.BF16: BF16Precision,
    PrecisionType.FP8: FP8Precision,
}


def precision_plugin(precision: PrecisionType | str, **kwargs: Any) -> AcceleratePrecision:
    """Build the plugin for an Accelerate precision name.

    Args:
        precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (or the ``PrecisionType``).
        **kwargs: Passed to the plugin, e.g. ``scaler_kwargs=GradScalerKwargs(...)`` or ``backend="te"``.

    Raises:
        ValueError: For any other name (the message lists the valid ones).

    """
    if str(precision) not in PrecisionType:
        raise ValueError(f"Unknown precision {str(precision)!r}; expected one of {PrecisionType.list()}.")
    return _BY_TYPE[PrecisionType(str(precision))](**kwargs)


def from_lightning(plugin: LightningPrecision) -> LightningPrecision:
    """Translate a plugin Lightning built from its precision string into this package's equivalent.

    ``Precision()`` ("32-true") becomes :class:`FP32Precision`, ``MixedPrecision`` ("16-mixed"/"bf16-mixed") becomes
    :class:`FP16Precision`/:class:`BF16Precision` on the same device, ``HalfPrecision`` ("16-true"/"bf16-true") becomes
    the ``mode="true"`` variant. Anything else (this package's plugins, double precision, a user's own) is kept.
    """
    from lightning.fabric.plugins import precision as fabric
    from lightning.pytorch.plugins import precision as trainer

    kind = type(plugin)  # exact classes: a subclass (a user's own plugin) is kept
    if kind in (trainer.Precision, fabric.Precision):
        return FP32Precision()
    mixed = (trainer.MixedPrecision, fabric.MixedPrecision)
    if kind in mixed and isinstance(plugin, mixed):
        if plugin.precision == "bf16-mixed":
            return BF16Precision(device=plugin.device)
        return FP16Precision(device=plugin.device, scaler=plugin.scaler)  # the user's scaler (or Lightning's default)
    if kind in (trainer.HalfPrecision, fabric.HalfPrecision):
        return BF16Precision(mode="true") if plugin.precision == "bf16-true" else FP16Precision(mode="true")
    if kind is fabric.FSDPPrecision:  # Fabric's connector builds it for acc_fsdp, a virtual Lightning FSDPStrategy
        return _from_fsdp_string(plugin.precision, plugin)
    return plugin


def _from_fsdp_string(precision: str, plugin: LightningPrecision) -> LightningPrecision:
    """The plugin of this package for the precision string of Lightning's ``FSDPPrecision`` (acc_fsdp shards itself)."""
    translations: dict[str, Callable[[], AcceleratePrecision]] = {
        "32-true": FP32Precision,
        "bf16-mixed": BF16Precision,
        "16-mixed": FP16Precision,
        "bf16-true": functools.partial(BF16Precision, mode="true"),
        "16-true": functools.partial(FP16Precision, mode="true"),
    }
    translated = translations.get(precision)
    return plugin if translated is None else translated()


def bind_device(plugin: LightningPrecision, device_type: str) -> None:
    """Tell an unbound plugin of this package which device type it runs on (validating the combination)."""
    if isinstance(plugin, AcceleratePrecision) and plugin.device != device_type:
        plugin.bind(device_type)


__all__ = [
    "AcceleratePrecision",
    "BF16Precision",
    "FP8Precision",
    "FP16Precision",
    "FP32Precision",
    "bind_device",
    "from_lightning",
    "precision_plugin",
]
