"""The ``Accelerator``'s kwargs handlers and precision answers: Accelerate's names, read from the precision plugin.

Accelerate keeps one attribute per kwargs handler (``ddp_handler``, ``scaler_handler``, ``init_handler``,
``autocast_handler``, ``profile_handler`` and the fp8 recipes) and exposes the loss scaler and whether autocast is on
(``scaler``, ``native_amp``). Here the handlers feed the strategy and precision plugin (see
:func:`lightning_accel._accelerator.fabric.split_handlers`), and the members read what the precision plugin built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import Precision

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

__all__ = ["KwargsHandlers", "MixedPrecision", "check_fp8_handlers"]

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


def check_fp8_handlers(handlers: KwargsHandlers, mixed_precision: str, dtype: DistributedType) -> None:
    """Refuse an fp8 recipe without ``mixed_precision='fp8'`` (outside FSDP and DeepSpeed), as Accelerate does.

    Raises:
        ValueError: Naming the recipe and the fix.

    """
    recipes = [type(recipe).__name__ for recipe in handlers.recipes()]
    if recipes and mixed_precision != PrecisionType.FP8 and dtype not in _FP8_WITHOUT_PRECISION:
        raise ValueError(
            f"kwargs_handlers holds {', '.join(recipes)}, an FP8 configuration, which requires"
            f" mixed_precision='fp8' (got {mixed_precision!r}): pass Accelerator(mixed_precision='fp8', ...)."
        )


@dataclass
class KwargsHandlers:
    """The ``Accelerator``'s kwargs handlers, one attribute each under Accelerate's name (``None`` where not given).

    The ``Accelerator`` exposes every field as its own attribute, as Accelerate does.
    """

    ddp_handler: DistributedDataParallelKwargs | None = None
    scaler_handler: GradScalerKwargs | None = None
    init_handler: InitProcessGroupKwargs | None = None
    autocast_handler: AutocastKwargs | None = None
    profile_handler: ProfileKwargs | None = None
    fp8_recipe_handler: FP8RecipeKwargs | None = None
    ao_recipe_handler: AORecipeKwargs | None = None
    te_recipe_handler: TERecipeKwargs | None = None
    msamp_recipe_handler: None = None  # lightning_accel has no MS-AMP backend: always None

    @classmethod
    def of(cls, handlers: Sequence[KwargsHandler] | None) -> KwargsHandlers:
        """The handlers of ``kwargs_handlers``, each under its attribute.

        Raises:
            TypeError: For an object that is not one of the supported handler classes.

        """
        attributes = cls()
        for handler in handlers or ():
            name = _ATTRIBUTE_BY_HANDLER.get(type(handler))
            if name is None:
                supported = ", ".join(cls.__name__ for cls in _ATTRIBUTE_BY_HANDLER)
                raise TypeError(f"Unsupported kwargs handler {handler!r}; supported: {supported}.")
            setattr(attributes, name, handler)
        return attributes

    def recipes(self) -> list[KwargsHandler]:
        """The fp8 recipes given."""
        found = (getattr(self, name) for name in _RECIPE_ATTRIBUTES)
        return [recipe for recipe in found if recipe is not None]

    @property
    def has_recipe(self) -> bool:
        """Whether an fp8 recipe was given."""
        return bool(self.recipes())


class MixedPrecision:
    """What the ``Accelerator`` says about its precision: the fp8 backend, the loss scaler, whether autocast runs.

    Args:
        fabric: The ``Accelerator``'s Fabric, whose strategy holds the precision plugin.
        strategy: The Fabric's strategy (an engine that steps in ``backward``, DeepSpeed, scales its own loss).
        state: The shared process state (the mixed-precision mode, the distributed type).
        handlers: The kwargs handlers (the fp8 recipes).

    """

    def __init__(
        self, *, fabric: Fabric, strategy: ShimStrategy, state: AcceleratorState, handlers: KwargsHandlers
    ) -> None:
        self._fabric = fabric
        self._strategy = strategy
        self._state = state
        self._handlers = handlers

    @property
    def has_fp8_handler(self) -> bool:
        """An fp8 recipe given, or ``mixed_precision='fp8'``."""
        return self._handlers.has_recipe or self.fp8_enabled

    @property
    def fp8_enabled(self) -> bool:
        """``mixed_precision='fp8'``."""
        return self._state.mixed_precision == PrecisionType.FP8

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The recipe's backend, else the precision plugin's, else ``ACCELERATE_FP8_BACKEND`` (``NO``)."""
        handlers = self._handlers
        if handlers.fp8_recipe_handler is not None:
            return FP8BackendType(str(handlers.fp8_recipe_handler.backend).upper())
        if handlers.ao_recipe_handler is not None:
            return FP8BackendType.AO
        if handlers.te_recipe_handler is not None:
            return FP8BackendType.TE
        backend = getattr(self._plugin, "backend", None) if self.fp8_enabled else None
        if isinstance(backend, str):
            return FP8BackendType(backend.upper())
        return FP8BackendType(str(settings_from_env().get("fp8_backend", "NO")).upper())

    @property
    def delayed_fp8_autocast(self) -> bool:
        """Transformer Engine's fp8 under a distributed wrapper."""
        distributed = self._state.distributed_type != DistributedType.NO
        return self.has_fp8_handler and self.fp8_backend == FP8BackendType.TE and distributed

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The precision plugin's scaler, unless an engine scales its own loss."""
        if self._strategy.engine_steps_in_backward:
            return None
        return getattr(self._plugin, "scaler", None)

    @property
    def native_amp(self) -> bool:
        """fp16/bf16 autocast outside DeepSpeed."""
        return self.autocasting_plugin() is not None

    def autocasting_plugin(self) -> AcceleratePrecision | None:
        """The precision plugin when it runs fp16/bf16 autocast (outside DeepSpeed), else ``None``."""
        precision = self._plugin
        if not isinstance(precision, AcceleratePrecision) or self._strategy.engine_steps_in_backward:
            return None
        mixed = precision.mode == "mixed" and precision.compute_dtype in (torch.float16, torch.bfloat16)
        return precision if mixed else None

    @property
    def _plugin(self) -> Precision:
        return self._fabric.strategy.precision
