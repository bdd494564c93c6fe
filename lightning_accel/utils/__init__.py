"""Mirror of ``accelerate.utils``: enums, configuration dataclasses and constants under their Accelerate names.

Every submodule's public names are imported here; ``__all__`` is built from the submodules' ``__all__`` lists, less
the few names that ``accelerate.utils`` leaves in its submodules (``_SUBMODULE_ONLY``), so each name is listed once,
in the module that defines it. Three names are imported one by one: ``ParallelismConfig`` (Accelerate's comes
from outside ``accelerate.utils``), ``load_full_state_dict`` (the checkpoint module's other names stay in it) and
``tqdm`` (the function has its module's name).
"""

from importlib import import_module as _import_module

from lightning_accel.config import ParallelismConfig as ParallelismConfig
from lightning_accel.utils.ao import *  # noqa: F403
from lightning_accel.utils.bnb import *  # noqa: F403
from lightning_accel.utils.checkpoint import load_full_state_dict as load_full_state_dict
from lightning_accel.utils.constants import *  # noqa: F403
from lightning_accel.utils.dataclasses import *  # noqa: F403
from lightning_accel.utils.deepspeed import *  # noqa: F403
from lightning_accel.utils.environment import *  # noqa: F403
from lightning_accel.utils.fsdp_utils import *  # noqa: F403
from lightning_accel.utils.imports import *  # noqa: F403
from lightning_accel.utils.launch import *  # noqa: F403
from lightning_accel.utils.memory import *  # noqa: F403
from lightning_accel.utils.modeling import *  # noqa: F403
from lightning_accel.utils.offload import *  # noqa: F403
from lightning_accel.utils.operations import *  # noqa: F403
from lightning_accel.utils.other import *  # noqa: F403
from lightning_accel.utils.random import *  # noqa: F403
from lightning_accel.utils.tqdm import tqdm as tqdm
from lightning_accel.utils.transformer_engine import *  # noqa: F403
from lightning_accel.utils.versions import *  # noqa: F403

# Public in a submodule (Accelerate's submodule has it too) but not re-exported by ``accelerate.utils`` itself.
_SUBMODULE_ONLY = frozenset(
    {
        "CPUInformation",
        "ConvertOutputsToFp32",
        "TENSOR_INT_TO_DTYPE",
        "TENSOR_TYPE_TO_INT",
        "TORCH_SAFE_GLOBALS",
        "USE_TORCH_XLA",
        "accelerator_kwargs",
        "apply_ac",
        "apply_fsdp2",
        "bnb_supports_device",
        "chained_operation",
        "check_device_same",
        "clean_device_map",
        "compute_module_total_buffer_size",
        "default_config_file",
        "env_from_settings",
        "fallback_allocate",
        "filter_linear_layers",
        "find_first_last_linear_layers",
        "fsdp2_prepare_auto_wrap_policy",
        "gather_tensor_shape",
        "get_driver_version",
        "get_free_port",
        "get_keys_to_not_convert",
        "get_module_leaves",
        "get_module_size_with_ties",
        "get_non_persistent_buffers",
        "get_parameters_from_modules",
        "get_quantized_model_device_map",
        "get_rng_states",
        "get_shape",
        "get_state_dict_from_offload",
        "get_state_dict_offloaded_model",
        "has_repeated_blocks",
        "is_repeated_blocks",
        "is_torch_xpu_tensor",
        "override_numa_affinity",
        "parallelism_config_from_env",
        "replace_with_bnb_layers",
        "resolve_settings",
        "set_rng_states",
        "settings_from_env",
        "torch_device_from_env",
        "torch_version",
        "verify_operation",
    }
)

_SUBMODULES = (
    "ao",
    "bnb",
    "constants",
    "dataclasses",
    "deepspeed",
    "environment",
    "fsdp_utils",
    "imports",
    "launch",
    "memory",
    "modeling",
    "offload",
    "operations",
    "other",
    "random",
    "transformer_engine",
    "versions",
)

__all__ = sorted(
    {
        name
        for module in _SUBMODULES
        for name in _import_module(f"{__name__}.{module}").__all__
        if name not in _SUBMODULE_ONLY
    }
    | {"ParallelismConfig", "load_full_state_dict", "tqdm"}
)
