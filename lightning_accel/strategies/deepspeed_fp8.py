"""fp8 under DeepSpeed, as Accelerate runs it: float8 Linears inside a DeepSpeed engine that trains in bf16.

Accelerate (``mixed_precision="fp8"`` with a DeepSpeed plugin) converts the model's ``nn.Linear`` layers to the fp8
backend's modules (torchao's ``Float8Linear``, or Transformer Engine's ``te.Linear`` plus its ``fp8_autocast`` around
the forward) *before* ``deepspeed.initialize``, and enables the config's ``bf16`` section: DeepSpeed keeps the fp32
master weights and casts the module to bf16, and the converted layers run their matmuls in float8.

:class:`TrainerFP8DeepSpeedPrecision` and :class:`FabricFP8DeepSpeedPrecision` do the same inside Lightning: they are
Lightning's ``DeepSpeedPrecision("bf16-mixed")`` (so DeepSpeed owns the casting, the loss scaling and the backward)
plus the conversion and the backend context of the :class:`~lightning_accel.precision.FP8Precision` they wrap.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.plugins.precision import DeepSpeedPrecision as FabricDeepSpeedPrecision
from lightning.pytorch.plugins import DeepSpeedPrecision as TrainerDeepSpeedPrecision
from torch.nn import Module
from typing_extensions import override

from lightning_accel.precision import FP8Precision

# The name DeepSpeed config reconciliation gets for an fp8 run (its bf16 section is enabled, as for "bf16-mixed").
FP8_FACTS_NAME = "fp8"


class _Float8Conversion(FabricPrecision):
    """What fp8 adds to a DeepSpeed bf16 precision: the Linear conversion and the backend's forward context."""

    def __init__(self, fp8: FP8Precision) -> None:
        super().__init__("bf16-mixed")  # type: ignore[call-arg]  # the DeepSpeedPrecision that follows in the MRO
        self.fp8 = fp8

    @override
    def convert_module(self, module: Module) -> Module:
        return super().convert_module(self.fp8.convert_module(module))

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with super().forward_context(), self.fp8.fp8_context():
            yield


class TrainerFP8DeepSpeedPrecision(_Float8Conversion, TrainerDeepSpeedPrecision):
    """Trainer precision for fp8 under ``acc_deepspeed``: DeepSpeed in bf16 around float8 Linears.

    Args:
        fp8: The plugin whose backend (``"ao"`` or ``"te"``) and recipe decide which Linears run in float8.

    """


class FabricFP8DeepSpeedPrecision(_Float8Conversion, FabricDeepSpeedPrecision):
    """Fabric twin of :class:`TrainerFP8DeepSpeedPrecision`.

    Args:
        fp8: The plugin whose backend (``"ao"`` or ``"te"``) and recipe decide which Linears run in float8.

    """


def fp8_deepspeed_precision(fp8: FP8Precision, deepspeed_precision: type) -> _Float8Conversion:
    """The fp8 DeepSpeed precision for the side (Trainer or Fabric) whose ``DeepSpeedPrecision`` class is given."""
    if issubclass(deepspeed_precision, TrainerDeepSpeedPrecision):
        return TrainerFP8DeepSpeedPrecision(fp8)
    return FabricFP8DeepSpeedPrecision(fp8)


def unwrap_fp8(plugin: Any) -> Any:
    """The :class:`FP8Precision` inside an fp8 DeepSpeed precision, else ``plugin`` itself."""
    return plugin.fp8 if isinstance(plugin, _Float8Conversion) else plugin


def facts_precision(plugin: Any) -> str:
    """The precision name DeepSpeed's config reconciliation takes: ``"fp8"`` for fp8, else Lightning's string."""
    return FP8_FACTS_NAME if isinstance(plugin, _Float8Conversion) else str(plugin.precision)
