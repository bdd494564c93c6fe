"""The ``Accelerator``'s side of a DeepSpeed config: the accumulation steps it adopts from the config, as Accelerate.

``Accelerator.prepare`` fills the config's ``"auto"`` entries through the strategy's ``configure_from_prepare`` (see
:mod:`lightning_accel.strategies.deepspeed_prepare`).
"""

from __future__ import annotations

from typing import Any

from lightning_accel.logging import get_logger
from lightning_accel.state import GradientState

__all__ = ["adopt_config_accumulation"]


def adopt_config_accumulation(plugin: Any, gradient_state: GradientState) -> None:
    """Take the DeepSpeed config's accumulation steps where they differ from the ``Accelerator``'s, as Accelerate.

    Accelerate's ``prepare`` warns and switches the ``Accelerator`` to the config's value (``transformers.Trainer``
    writes its ``gradient_accumulation_steps`` into the config and leaves the ``Accelerator`` at 1). The engine is
    built with the value here, so the ``Accelerator`` adopts it when it starts, before the strategy is built.

    Args:
        plugin: The ``DeepSpeedPlugin``, or ``None``.
        gradient_state: The shared accumulation state, changed in place.

    """
    configured = getattr(plugin, "deepspeed_config", {}).get("gradient_accumulation_steps")
    if not isinstance(configured, int) or configured == gradient_state.num_steps:
        return
    get_logger(__name__).warning(
        f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has {gradient_state.num_steps}, DeepSpeed"
        f" config has {configured}. Using DeepSpeed's value."
    )
    gradient_state.plugin_kwargs["num_steps"] = configured
