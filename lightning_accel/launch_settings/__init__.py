"""Launch settings: how a run's configuration reaches its processes and is resolved there.

A leaf package below :mod:`lightning_accel.state`, importing only the config layer: single-variable readers
(:mod:`~lightning_accel.launch_settings.env`), helpers that set variables for a block of code
(:mod:`~lightning_accel.launch_settings.patching`), and the settings resolution with the precedence explicit
arguments > environment > config file (:mod:`~lightning_accel.launch_settings.resolution`). Accelerate's public names
among them stay importable from :mod:`lightning_accel.utils.environment`.
"""

from lightning_accel.launch_settings.env import (
    convert_dict_to_env_variables,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    str_to_bool,
    torch_device_from_env,
)
from lightning_accel.launch_settings.patching import clear_environment, patch_environment, purge_accelerate_environment
from lightning_accel.launch_settings.resolution import (
    accelerator_kwargs,
    cpu_threads_per_process,
    default_config_file,
    env_from_settings,
    parallelism_config_from_env,
    resolve_settings,
    settings_from_env,
    write_basic_config,
)

__all__ = [
    "accelerator_kwargs",
    "clear_environment",
    "convert_dict_to_env_variables",
    "cpu_threads_per_process",
    "default_config_file",
    "env_from_settings",
    "get_int_from_env",
    "parallelism_config_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "resolve_settings",
    "settings_from_env",
    "str_to_bool",
    "torch_device_from_env",
    "write_basic_config",
]
