"""Mirror of ``accelerate.utils.modeling``: the model helpers of big-model inference, under their Accelerate names.

They live in one module per idea; this module gathers them at Accelerate's import path:

- :mod:`~lightning_accel.utils.modeling_tensors`: moving one tensor, listing a module's tensors, tied weights;
- :mod:`~lightning_accel.utils.modeling_sizes`: byte sizes and per-device memory budgets;
- :mod:`~lightning_accel.utils.modeling_device_map`: planning and checking device maps;
- :mod:`~lightning_accel.utils.modeling_checkpoint`: loading (sharded) checkpoints through a device map;
- :mod:`~lightning_accel.utils.modeling_offloaded`: reading the weights of an offloaded model.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from lightning_accel.utils.amp import get_grad_scaler, get_mixed_precision_context_manager
from lightning_accel.utils.constants import WEIGHTS_INDEX_NAME
from lightning_accel.utils.modeling_checkpoint import load_checkpoint_in_model, load_offloaded_weights, load_state_dict
from lightning_accel.utils.modeling_device_map import (
    check_device_map,
    clean_device_map,
    fallback_allocate,
    get_module_size_with_ties,
    infer_auto_device_map,
)
from lightning_accel.utils.modeling_offloaded import (
    align_module_device,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    has_offloaded_params,
)
from lightning_accel.utils.modeling_sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    get_module_leaves,
)
from lightning_accel.utils.modeling_tensors import (
    check_device_same,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from lightning_accel.utils.other import extract_model_from_parallel

__all__ = [
    "WEIGHTS_INDEX_NAME",
    "align_module_device",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "fallback_allocate",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "id_tensor_storage",
    "infer_auto_device_map",
    "is_peft_model",
    "load_checkpoint_in_model",
    "load_offloaded_weights",
    "load_state_dict",
    "named_module_tensors",
    "retie_parameters",
    "set_module_tensor_to_device",
    "verify_device_map",
]


def verify_device_map(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) was dispatched with a device map of more than one entry.

    Accelerate's ``Accelerator.verify_device_map``: such a model is spread over devices (or offloaded) by hooks, so
    it can run inference but is refused for training.
    """
    return any(len(getattr(module, "hf_device_map", None) or {}) > 1 for module in model.modules())


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (unwrapped from DDP/compile wrappers) is a ``peft.PeftModel``."""
    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)
