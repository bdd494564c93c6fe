"""Accelerate's bitsandbytes quantization: linear layers replaced by 8-bit or 4-bit ones while the model loads.

``bitsandbytes`` is imported only when a function here runs. Where Accelerate 1.15 needs a CUDA (or XPU) device,
this module runs wherever the installed bitsandbytes has kernels for the mode: bitsandbytes 0.48 and newer register
CPU (and default pure-torch) kernels for LLM.int8() and 4-bit layers, so on a machine without an accelerator the
model is quantized and run on the CPU instead of refused. Quantized modules mapped to ``"cpu"`` are offloaded only
when the main device is an accelerator; with the CPU as main device they simply run there (4-bit ones included,
which Accelerate refuses on ``"cpu"``). The user's :class:`~lightning_accel.utils.BnbQuantizationConfig` is left as
it was passed (Accelerate extends its ``skip_modules`` in place).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from lightning_accel.config.quantization import BnbQuantizationConfig
from lightning_accel.utils.imports import is_4bit_bnb_available, is_8bit_bnb_available, is_bnb_available
from lightning_accel.utils.modeling.checkpoint import load_checkpoint_in_model
from lightning_accel.utils.modeling.device_map import DEVICE_MAP_STRATEGIES, strategy_device_map

# Importable from here, as from ``accelerate.utils.bnb`` (which imports them).
from lightning_accel.utils.modeling.device_map import infer_auto_device_map as infer_auto_device_map
from lightning_accel.utils.modeling.sizes import get_balanced_memory as get_balanced_memory
from lightning_accel.utils.modeling.tensors import DeviceLike, find_tied_parameters, resolve_device

__all__ = [
    "bnb_supports_device",
    "get_keys_to_not_convert",
    "get_quantized_model_device_map",
    "has_4bit_bnb_layers",
    "load_and_quantize_model",
    "replace_with_bnb_layers",
]

logger = logging.getLogger(__name__)

# The bitsandbytes operator each mode's forward needs (registered through torch.library from bitsandbytes 0.45 on).
_MODE_OPERATORS = {"8-bit": "bitsandbytes::int8_linear_matmul", "4-bit": "bitsandbytes::dequantize_4bit"}


def _import_bnb(mode: str) -> ModuleType:
    """``bitsandbytes``, or an error naming the install (and the version ``mode`` needs)."""
    if not is_bnb_available():
        raise ImportError(f"{mode} quantization needs bitsandbytes, which is not installed: `pip install bitsandbytes`")
    if mode == "8-bit" and not is_8bit_bnb_available():
        raise ImportError("8-bit quantization needs bitsandbytes 0.37.2 or newer: `pip install -U bitsandbytes`.")
    if mode == "4-bit" and not is_4bit_bnb_available():
        raise ImportError("4-bit quantization needs bitsandbytes 0.39.0 or newer: `pip install -U bitsandbytes`.")
    import bitsandbytes

    return bitsandbytes


def _mode(config: BnbQuantizationConfig) -> str:
    return "8-bit" if config.load_in_8bit else "4-bit"


def bnb_supports_device(mode: str, device: DeviceLike) -> bool:
    """Whether the installed bitsandbytes can run ``mode`` (``"8-bit"`` or ``"4-bit"``) layers on ``device``.

    CUDA always can; another device can when bitsandbytes registered a kernel of the mode's operator for it (or a
    device-independent default one).

    Raises:
        ValueError: For a ``mode`` other than those two.

    """
    if mode not in _MODE_OPERATORS:
        raise ValueError(f"mode must be one of {list(_MODE_OPERATORS)}, got {mode!r}.")
    target = resolve_device(device)
    _import_bnb(mode)
    if target.type == "cuda":
        return True
    operator = _MODE_OPERATORS[mode]
    if not torch._C._dispatch_has_kernel(operator):
        return False
    keys = ["CompositeExplicitAutograd", "PrivateUse1" if target.type == "privateuseone" else target.type.upper()]
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(operator, key) for key in keys)


def _check_device(config: BnbQuantizationConfig, device: DeviceLike) -> None:
    mode = _mode(config)
    if not bnb_supports_device(mode, device):
        import bitsandbytes

        raise ValueError(
            f"bitsandbytes {bitsandbytes.__version__} has no {mode} kernels for device {str(device)!r}. Run the "
            "quantized layers on a CUDA device, or install a bitsandbytes with a backend for this device "
            "(0.48 or newer has CPU kernels: `pip install -U bitsandbytes`)."
        )


def _default_device() -> torch.device:
    """The current accelerator (Accelerate's default), else the CPU."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _skipped(name: str, modules_to_not_convert: list[str]) -> bool:
    """Accelerate's rule: a key skips the module it names and every module below it."""
    return any((key in name and f"{key}." in name) or key == name for key in modules_to_not_convert)


def _quantized_linear(bnb: ModuleType, module: nn.Linear, config: BnbQuantizationConfig) -> nn.Module:
    has_bias = module.bias is not None
    if config.load_in_8bit:
        layer = bnb.nn.Linear8bitLt(
            module.in_features, module.out_features, has_bias, has_fp16_weights=False,
            threshold=config.llm_int8_threshold,
        )  # fmt: skip
    else:
        layer = bnb.nn.Linear4bit(
            module.in_features, module.out_features, has_bias, config.bnb_4bit_compute_dtype,
            compress_statistics=config.bnb_4bit_use_double_quant, quant_type=config.bnb_4bit_quant_type,
        )  # fmt: skip
    layer.weight.data = module.weight.data
    if module.bias is not None:
        layer.bias.data = module.bias.data
    layer.requires_grad_(False)
    return layer


def replace_with_bnb_layers(
    model: nn.Module, bnb_quantization_config: BnbQuantizationConfig, modules_to_not_convert: list[str] | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by bitsandbytes' ``Linear8bitLt`` or ``Linear4bit``.

    The new layers hold the old weights unquantized; bitsandbytes quantizes them when they move to a device.

    Args:
        model: The model.
        bnb_quantization_config: Which mode, and its settings.
        modules_to_not_convert: Module names left as they are (each with everything below it).

    Returns:
        ``model``.

    """
    bnb = _import_bnb(_mode(bnb_quantization_config))
    skipped = modules_to_not_convert or []
    replaced = False
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full_name = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and child_name not in skipped and not _skipped(full_name, skipped):
                setattr(module, child_name, _quantized_linear(bnb, child, bnb_quantization_config))
                replaced = True
    if not replaced:
        logger.warning(
            "You are loading your model in 8bit or 4bit but no linear modules were found in your model. this can "
            "happen for some architectures such as gpt2 that uses Conv1D instead of Linear layers."
        )
    return model


def get_keys_to_not_convert(model: nn.Module) -> list[str]:
    """The modules Accelerate keeps unquantized by default: the tied weights' modules and the model's last child.

    A transformers base model (no head) without tied weights keeps none.
    """
    tied_keys = [name for group in find_tied_parameters(model) for name in group]
    prefix = getattr(model, "base_model_prefix", None)
    if not tied_keys and prefix is not None and not hasattr(model, prefix):
        return []
    children = [name for name, _ in model.named_children()]
    last = set(children[-1:]) - set(tied_keys)
    names = [*dict.fromkeys(tied_keys), *last]
    return [name.replace(".weight", "").replace(".bias", "") for name in names]


def has_4bit_bnb_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a bitsandbytes ``Linear4bit`` layer."""
    bnb = _import_bnb("4-bit")
    return any(isinstance(module, bnb.nn.Linear4bit) for module in model.modules())


def _special_dtypes(model: nn.Module, skip: list[str], keep_in_fp32: list[str], dtype: torch.dtype) -> dict[str, Any]:
    names = [name for name, _ in model.named_parameters()]
    special: dict[str, Any] = {name: dtype for name in names if any(key in name for key in skip)}
    special.update({name: torch.float32 for name in names if any(key in name for key in keep_in_fp32)})
    return special


def get_quantized_model_device_map(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    device_map: str | Mapping[str, DeviceLike] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    modules_to_not_convert: list[str] | None = None,
) -> dict[str, DeviceLike]:
    """The device map of a model whose linear layers were replaced: quantized layers sized in int8/int4.

    Args:
        model: The model (on the meta device), after :func:`replace_with_bnb_layers`.
        bnb_quantization_config: Its quantization settings.
        device_map: A map, one of ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, or ``None``
            (everything on the current accelerator, else on the CPU).
        max_memory: Budget per device for a computed map.
        no_split_module_classes: Class names never split across devices.
        modules_to_not_convert: The unquantized modules (default: the config's ``skip_modules``).

    Returns:
        The device map.

    Raises:
        ValueError: For an unknown map strategy, or quantized 4-bit modules offloaded (to ``"disk"``, or to
            ``"cpu"`` while an accelerator is the main device).

    """
    skip = modules_to_not_convert if modules_to_not_convert is not None else bnb_quantization_config.skip_modules or []
    keep_in_fp32 = bnb_quantization_config.keep_in_fp32_modules or []
    if device_map is None:
        return {"": _default_device().index if _default_device().type != "cpu" else "cpu"}
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(f"device_map must be a dict or one of {list(DEVICE_MAP_STRATEGIES)}, got {device_map!r}.")
        assert isinstance(bnb_quantization_config.torch_dtype, torch.dtype)
        special = _special_dtypes(model, skip, keep_in_fp32, bnb_quantization_config.torch_dtype)
        dtype = bnb_quantization_config.target_dtype
        device_map = strategy_device_map(model, device_map, max_memory, no_split_module_classes, dtype, special)  # type: ignore[arg-type]
    device_map = dict(device_map)
    offloaded = _offloaded_places(device_map)
    quantized = {name: device for name, device in device_map.items() if name not in skip + keep_in_fp32}
    stranded = sorted(name for name, device in quantized.items() if device in offloaded)
    if stranded and bnb_quantization_config.load_in_4bit:
        raise ValueError(
            f"4-bit modules {stranded} would be offloaded ({', '.join(offloaded)}), which bitsandbytes' 4-bit layers "
            "cannot be. Give the main device more memory (max_memory), or list these modules in skip_modules to "
            "keep them unquantized in torch_dtype."
        )
    if stranded:
        logger.info(f"Modules {stranded} are offloaded; their weights are offloaded as 8-bit ones.")
    return device_map


def _offloaded_places(device_map: Mapping[str, DeviceLike]) -> tuple[str, ...]:
    """Where weights are offloaded rather than run: the disk, and the CPU when an accelerator is the main device."""
    from lightning_accel.big_modeling import _main_device

    return ("disk",) if _main_device(list(device_map.values())) in ("cpu", "mps") else ("cpu", "disk")


def _cast_loaded(model: nn.Module, dtype: torch.dtype, keep_in_fp32: list[str]) -> None:
    """Unquantized weights in ``dtype`` (``keep_in_fp32`` modules' in float32), tied aliases included."""
    for name, module in model.named_modules():
        keep = any(key in name for key in keep_in_fp32)
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{name}.{param_name}" if name else param_name
            if keep or any(key in full for key in keep_in_fp32):
                param.data = param.data.to(torch.float32)
            elif torch.is_floating_point(param):
                param.data = param.data.to(dtype)


def load_and_quantize_model(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    weights_location: str | os.PathLike[str] | None = None,
    device_map: str | Mapping[str, DeviceLike] | None = None,
    no_split_module_classes: list[str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_state_dict: bool = False,
) -> nn.Module:
    """Quantize ``model``'s linear layers with bitsandbytes, loading (and dispatching) its weights when it is empty.

    A model built under :func:`~lightning_accel.init_empty_weights` is quantized as its checkpoint loads, then
    dispatched with ``device_map``; an already loaded model is quantized and moved to the current accelerator, or
    kept on the CPU where bitsandbytes runs there.

    Args:
        model: The model, on the meta device (recommended) or loaded.
        bnb_quantization_config: The quantization settings. ``skip_modules`` defaults to
            :func:`get_keys_to_not_convert`.
        weights_location: The checkpoint of an empty model (a file, a sharded checkpoint's index, or a folder).
        device_map: Where each module goes (see :func:`get_quantized_model_device_map`).
        no_split_module_classes: Class names never split across devices.
        max_memory: Budget per device for a computed map.
        offload_folder: Where ``"disk"`` weights are written (8-bit ones quantized first).
        offload_state_dict: Keep the CPU part on disk while loading.

    Returns:
        The quantized model (``is_loaded_in_8bit`` / ``is_loaded_in_4bit`` set).

    Raises:
        ImportError: Without bitsandbytes (or with one too old for the mode).
        ValueError: For an empty model without ``weights_location``, or a device bitsandbytes cannot run the mode
            on.

    """
    from lightning_accel.big_modeling import _main_device, dispatch_model, init_empty_weights

    config = bnb_quantization_config
    _import_bnb(_mode(config))
    skip = list(config.skip_modules) if config.skip_modules is not None else get_keys_to_not_convert(model)
    keep_in_fp32 = list(config.keep_in_fp32_modules or [])
    if config.load_in_4bit and isinstance(device_map, Mapping) and len(device_map) > 1:
        skip += [name for name, device in device_map.items() if device in _offloaded_places(device_map)]
    skip += keep_in_fp32
    model.is_loaded_in_4bit = config.load_in_4bit  # type: ignore[assignment]
    model.is_loaded_in_8bit = config.load_in_8bit  # type: ignore[assignment]
    assert isinstance(config.torch_dtype, torch.dtype)

    first = next(model.parameters(), None)
    if first is not None and first.device.type != "meta":
        logger.warning(
            "It is not recommended to quantize a loaded model. The model should be instantiated under the "
            "`init_empty_weights` context manager."
        )
        device = _default_device() if first.device.type == "cpu" else first.device
        _check_device(config, device)
        replace_with_bnb_layers(model, config, modules_to_not_convert=skip)
        _cast_loaded(model, config.torch_dtype, keep_in_fp32)
        return model.to(device)
    if weights_location is None:
        raise ValueError(
            f"{type(model).__name__} is on the meta device: pass `weights_location`, the checkpoint (file, index or "
            "folder) to load its weights from."
        )
    with init_empty_weights():
        replace_with_bnb_layers(model, config, modules_to_not_convert=skip)
    device_map = get_quantized_model_device_map(
        model, config, device_map, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
        modules_to_not_convert=skip,
    )  # fmt: skip
    offloaded = _offloaded_places(device_map)
    main = _main_device(list(device_map.values()))
    for place in {main, *(d for name, d in device_map.items() if d not in offloaded and name not in skip)}:
        _check_device(config, place)
    load_checkpoint_in_model(
        model, weights_location, device_map, dtype=config.torch_dtype, offload_folder=offload_folder,
        offload_state_dict=offload_state_dict, keep_in_fp32_modules=keep_in_fp32,
        offload_8bit_bnb=config.load_in_8bit and any(device in offloaded for device in device_map.values()),
    )  # fmt: skip
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder)
