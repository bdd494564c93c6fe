"""Lightning's ``PL_DEEPSPEED_CONFIG_PATH`` for the ``acc_deepspeed*`` strategies.

Lightning's ``DeepSpeedStrategy`` reads its DeepSpeed config from the JSON file this variable names whenever it is
given no config. The ``acc_deepspeed*`` strategies do the same when they are given no ``deepspeed_plugin``: the file
becomes ``DeepSpeedPlugin(hf_ds_config=path)``, its ``"auto"`` entries filled as usual.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_accel.config import DeepSpeedPlugin

LIGHTNING_CONFIG_VARIABLE = "PL_DEEPSPEED_CONFIG_PATH"


def plugin_from_lightning_variable(
    strategy_name: str,
    plugin: DeepSpeedPlugin | None,
    plugin_fields: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
) -> DeepSpeedPlugin | None:
    """The plugin for the file ``PL_DEEPSPEED_CONFIG_PATH`` names, if it is set and no plugin was given.

    Args:
        strategy_name: The registered name, for messages.
        plugin: The plugin the strategy was given; the variable is ignored when there is one (as Lightning ignores
            it when given a config).
        plugin_fields: The fields a name such as ``acc_deepspeed_stage_3`` fixes; the file must agree with them.
        environ: The environment to read (default ``os.environ``).

    Raises:
        FileNotFoundError: If the variable names no file.
        ValueError: If the file disagrees with a field the strategy name fixes (its ZeRO stage, its offload devices).

    """
    path = (os.environ if environ is None else environ).get(LIGHTNING_CONFIG_VARIABLE)
    if plugin is not None or not path:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{LIGHTNING_CONFIG_VARIABLE}={path!r} names no file: point it at a DeepSpeed JSON config, or unset it."
        )
    rank_zero_info(f"Loading DeepSpeed config from set {LIGHTNING_CONFIG_VARIABLE} environment variable")
    loaded = DeepSpeedPlugin(hf_ds_config=path)
    for field, fixed in (plugin_fields or {}).items():
        if getattr(loaded, field) != fixed:
            raise ValueError(
                f"Strategy {strategy_name!r} runs with {field}={fixed!r}, but the DeepSpeed config that"
                f" {LIGHTNING_CONFIG_VARIABLE} names ({path}) gives {field}={getattr(loaded, field)!r}. Use strategy"
                " 'acc_deepspeed' to run the file as it is, or make the file agree."
            )
    return loaded
