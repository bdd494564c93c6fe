"""The ``Accelerator``'s kwargs handlers and precision members: Accelerate's names, answered by the precision plugin.

Accelerate keeps one attribute per kwargs handler (``ddp_handler``, ``scaler_handler``, ``init_handler``,
``autocast_handler``, ``profile_handler`` and the fp8 recipes) and exposes the loss scaler and whether autocast is on
(``scaler``, ``native_amp``). Here the handlers feed the strategy and precision plugin (see
:func:`lightning_accel._shim.fabric.split_handlers`), and the members read what the precision plugin built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_accel.config import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from lightning_accel.config.fp8 import AORecipeKwargs, FP8RecipeKwargs, TERecipeKwargs
from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.enums import DistributedType, FP8BackendType, PrecisionType
from lightning_accel.launch_settings import settings_from_env
from lightning_accel.precision.base import AcceleratePrecision
from lightning_accel.state import AcceleratorState
from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["PrecisionMembers", "check_fp8_handlers", "handler_attributes"]

# Accelerate's attribute for each kwargs handler class.
_ATTRIBUTE_BY_HANDLER: dict[type[KwargsHandler], str] = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
    AORecipeKwargs: "ao_recipe_handler",
    TERecipeKwargs: "te_recipe_handler",
}
_RECIPE_ATTRIBUTES = ("fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler")
# Sharding engines that take an fp8 recipe without mixed_precision='fp8' (they cast themselves), as in Accelerate.
_FP8_WITHOUT_PRECISION = (DistributedType.FSDP, DistributedType.DEEPSPEED)


def handler_attributes(handlers: Sequence[KwargsHandler] | None) -> dict[str, KwargsHandler | None]:
    """Accelerate's handler attributes (all of them, ``None`` where not given) for ``kwargs_handlers``.

    Raises:
        TypeError: For an object that is not one of the supported handler classes.

    """
    attributes: dict[str, KwargsHandler | None] = dict.fromkeys((*_ATTRIBUTE_BY_HANDLER.values(), *_RECIPE_ATTRIBUTES))
    for handler in handlers or ():
        name = _ATTRIBUTE_BY_HANDLER.get(type(handler))
        if name is None:
            supported = ", ".join(cls.__name__ for cls in _ATTRIBUTE_BY_HANDLER)
            raise TypeError(f"Unsupported kwargs handler {handler!r}; supported: {supported}.")
        attributes[name] = handler
    return attributes


def check_fp8_handlers(attributes: dict[str, Any], mixed_precision: str, dtype: DistributedType) -> None:
    """Refuse an fp8 recipe without ``mixed_precision='fp8'`` (outside FSDP and DeepSpeed), as Accelerate does.

    Raises:
        ValueError: Naming the recipe and the fix.

    """
    recipes = [type(attributes[name]).__name__ for name in _RECIPE_ATTRIBUTES if attributes.get(name) is not None]
    if recipes and mixed_precision != PrecisionType.FP8 and dtype not in _FP8_WITHOUT_PRECISION:
        raise ValueError(
            f"kwargs_handlers holds {', '.join(recipes)}, an FP8 configuration, which requires"
            f" mixed_precision='fp8' (got {mixed_precision!r}): pass Accelerator(mixed_precision='fp8', ...)."
        )


class PrecisionMembers:
    """Accelerate's handler attributes, ``scaler``, ``native_amp`` and the fp8 members, for the ``Accelerator``."""

    fabric: Fabric
    _strategy: ShimStrategy
    state: AcceleratorState
    ddp_handler: DistributedDataParallelKwargs | None = None
    scaler_handler: GradScalerKwargs | None = None
    init_handler: InitProcessGroupKwargs | None = None
    autocast_handler: AutocastKwargs | None = None
    profile_handler: ProfileKwargs | None = None
    fp8_recipe_handler: FP8RecipeKwargs | None = None
    ao_recipe_handler: AORecipeKwargs | None = None
    te_recipe_handler: TERecipeKwargs | None = None
    msamp_recipe_handler: Any = None  # lightning_accel has no MS-AMP backend: always None

    def _adopt_handlers(self, attributes: dict[str, Any]) -> None:
        """Set the handler attributes from :func:`handler_attributes`."""
        for name, handler in attributes.items():
            setattr(self, name, handler)

    @property
    def has_fp8_handler(self) -> bool:
        """Whether an fp8 recipe was given, or (with ``mixed_precision='fp8'``) the precision plugin chose one."""
        return any(getattr(self, name) is not None for name in _RECIPE_ATTRIBUTES) or self.fp8_enabled

    @property
    def fp8_enabled(self) -> bool:
        """Whether the run trains in fp8 (``mixed_precision='fp8'``)."""
        return self.state.mixed_precision == PrecisionType.FP8

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The fp8 library: the recipe's, else the precision plugin's, else ``ACCELERATE_FP8_BACKEND`` (``NO``)."""
        if self.fp8_recipe_handler is not None:
            return FP8BackendType(str(self.fp8_recipe_handler.backend).upper())
        if self.ao_recipe_handler is not None:
            return FP8BackendType.AO
        if self.te_recipe_handler is not None:
            return FP8BackendType.TE
        backend = getattr(self._precision, "backend", None) if self.fp8_enabled else None
        if isinstance(backend, str):
            return FP8BackendType(backend.upper())
        return FP8BackendType(str(settings_from_env().get("fp8_backend", "NO")).upper())

    @property
    def delayed_fp8_autocast(self) -> bool:
        """Whether Transformer Engine's fp8 autocast wraps the model after the strategy's wrapper (DDP, FSDP)."""
        distributed = self.state.distributed_type != DistributedType.NO
        return self.has_fp8_handler and self.fp8_backend == FP8BackendType.TE and distributed

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler of the precision plugin (``None`` without fp16, on CPU and under DeepSpeed)."""
        if self._strategy.engine_steps_in_backward:
            return None
        return getattr(self._precision, "scaler", None)

    @property
    def native_amp(self) -> bool:
        """Whether ``torch.autocast`` runs the forward (fp16/bf16/fp8 mixed precision outside DeepSpeed)."""
        precision = self._precision
        if not isinstance(precision, AcceleratePrecision) or self._strategy.engine_steps_in_backward:
            return False
        return precision.mode == "mixed" and precision.compute_dtype in (torch.float16, torch.bfloat16)

    @property
    def _precision(self) -> Any:
        return self.fabric.strategy.precision
