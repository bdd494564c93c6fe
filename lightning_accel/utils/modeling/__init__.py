"""Mirror of ``accelerate.utils.modeling``: the model helpers of big-model inference, under their Accelerate names.

They live in one module per idea; this module gathers them at Accelerate's import path:

- :mod:`~lightning_accel.utils.modeling.tensors`: moving one tensor, listing a module's tensors, tied weights;
- :mod:`~lightning_accel.utils.modeling.sizes`: byte sizes and per-device memory budgets;
- :mod:`~lightning_accel.utils.modeling.device_map`: planning and checking device maps;
- :mod:`~lightning_accel.utils.modeling.checkpoint`: loading (sharded) checkpoints through a device map;
- :mod:`~lightning_accel.utils.modeling.offloaded`: reading the weights of an offloaded model.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_accel.config import AutocastKwargs
from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.state import AcceleratorState
from lightning_accel.utils.constants import WEIGHTS_INDEX_NAME
from lightning_accel.utils.modeling.checkpoint import load_checkpoint_in_model, load_offloaded_weights, load_state_dict
from lightning_accel.utils.modeling.device_map import (
    check_device_map,
    clean_device_map,
    fallback_allocate,
    get_module_size_with_ties,
    infer_auto_device_map,
)
from lightning_accel.utils.modeling.offloaded import (
    align_module_device,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    has_offloaded_params,
)
from lightning_accel.utils.modeling.sizes import (
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
from lightning_accel.utils.modeling.tensors import (
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


# fp8 layers run their own matmuls; everything around them autocasts to bf16, as in Accelerate.
_AUTOCAST_DTYPES = {
    PrecisionType.FP16.value: torch.float16,
    PrecisionType.BF16.value: torch.bfloat16,
    PrecisionType.FP8.value: torch.bfloat16,
}
FP16_NEEDS_A_GPU = (
    "fp16 mixed precision needs a GPU, but this run trains on CPU. Use bf16 on CPU"
    " (mixed_precision='bf16', or Trainer(precision='bf16-mixed'))."
)


def default_device_type() -> str:
    """The device type autocast targets when nothing else says: the current accelerator, else CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def cuda_bf16_problem(device_name: str, *, native: bool) -> str | None:
    """Why bf16 should not run on this GPU (``None`` when it may): torch emulates bf16 where it is not native.

    Args:
        device_name: The GPU's name, for the message.
        native: ``torch.cuda.is_bf16_supported(including_emulation=False)``.

    """
    if native:
        return None
    return (
        f"bf16 needs a GPU with native bfloat16 support (Ampere or newer), but {device_name} would only emulate it,"
        " which is slower than fp32. Use fp16 (mixed_precision='fp16' / precision='16-mixed') on this GPU."
    )


def autocast_problem(device_type: str, dtype: torch.dtype) -> str | None:
    """Why mixed precision in ``dtype`` should not autocast on ``device_type`` (``None`` when it may).

    fp16 autocast needs a GPU (on CPU torch gives no speed-up and Accelerate silently trains in fp32); bf16 on CUDA
    needs native support.
    """
    if dtype == torch.float16 and device_type == "cpu":
        return FP16_NEEDS_A_GPU
    if dtype == torch.bfloat16 and device_type == "cuda" and torch.cuda.is_available():
        return cuda_bf16_problem(
            torch.cuda.get_device_name(), native=torch.cuda.is_bf16_supported(including_emulation=False)
        )
    return None


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager[Any]:
    """The autocast context of the run's ``mixed_precision`` (from :class:`~lightning_accel.state.AcceleratorState`).

    Args:
        native_amp: Whether mixed precision is on at all; ``False`` gives a no-op context.
        autocast_kwargs: ``enabled`` / ``cache_enabled`` for ``torch.autocast``.

    Returns:
        ``torch.autocast`` on the state's device in fp16 (``"fp16"``) or bf16 (``"bf16"``, ``"fp8"``); a no-op context
        when ``native_amp`` is off or the precision is ``"no"``.

    Raises:
        ValueError: For fp16 on CPU (fp16 autocast needs a GPU; use bf16), as the precision plugins do.

    """
    state = AcceleratorState()
    dtype = _AUTOCAST_DTYPES.get(str(state.mixed_precision)) if native_amp else None
    if dtype is None:
        return nullcontext()
    problem = autocast_problem(state.device.type, dtype)
    if problem is not None:
        raise ValueError(problem)
    return torch.autocast(state.device.type, dtype=dtype, **(autocast_kwargs or AutocastKwargs()).to_kwargs())


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> torch.amp.GradScaler:
    """A gradient scaler for the current accelerator: FSDP's ``ShardedGradScaler`` under FSDP, else ``torch.amp``'s.

    Args:
        distributed_type: The run's distributed type (only ``FSDP`` changes the scaler).
        **kwargs: ``GradScaler`` arguments (``init_scale``, ``growth_factor``, ``backoff_factor``, ...).

    """
    device = default_device_type()
    if device == "cpu":
        device = "cuda"  # as Accelerate: without CUDA, torch disables this scaler with a warning
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
