"""Mirror of ``accelerate.utils.deepspeed``: DeepSpeed's optimizer/scheduler placeholders, active plugin."""

from __future__ import annotations

from typing import Any

from lightning_accel._dummies import DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.enums import DistributedType

__all__ = ["DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler", "get_active_deepspeed_plugin"]


def get_active_deepspeed_plugin(state: Any) -> DeepSpeedPlugin:
    """The DeepSpeed plugin a run uses, read from its state (``AcceleratorState()``).

    The state holds it as Accelerate's does: ``state.deepspeed_plugins`` is one plugin, or a dict of named plugins of
    which the ``selected`` one is active.

    Raises:
        ValueError: If the state's run does not use DeepSpeed, or records no (or no selected) plugin.

    """
    if state.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError(
            f"There is no active DeepSpeedPlugin: the run is {state.distributed_type}, not DEEPSPEED; create the "
            "Accelerator with deepspeed_plugin=DeepSpeedPlugin(...) (or launch with a DeepSpeed config) first"
        )
    plugins = getattr(state, "deepspeed_plugins", None)
    if isinstance(plugins, dict):
        selected = [plugin for plugin in plugins.values() if getattr(plugin, "selected", False)]
        if not selected:
            raise ValueError(
                f"None of the DeepSpeed plugins {sorted(plugins)} is selected; select one with "
                "AcceleratorState().select_deepspeed_plugin(name)"
            )
        return selected[0]
    if plugins is None:
        raise ValueError(
            "The state runs DeepSpeed but records no plugin (state.deepspeed_plugins is unset); the Accelerator "
            "that set up DeepSpeed must store its DeepSpeedPlugin there"
        )
    return plugins
