"""Accelerate's big-model inference: build a model without memory, load it across devices, offload what does not fit.

The usual flow, for a model larger than one device (or than RAM)::

    with init_empty_weights():
        model = MyModel(config)  # parameters on the meta device: no memory used
    model = load_checkpoint_and_dispatch(model, "checkpoint/", device_map="auto", offload_folder="offload/")

``device_map="auto"`` fills the accelerators, then the CPU, then the disk (see
:func:`~lightning_accel.utils.modeling.infer_auto_device_map`); :func:`dispatch_model` attaches the hooks that move
each block's inputs, and its offloaded weights, to the right device during ``forward``. :func:`cpu_offload` and
:func:`disk_offload` keep a whole model offloaded, loading each layer's weights only for its call.

Where Accelerate 1.15 fails, this module does not: a weight tied in a constructor stays tied under
:func:`init_empty_weights`; a tied weight a (safetensors) checkpoint stores under one name only is read under each of
its names when offloaded; and a map entry naming a single tensor on an offloaded device (a split module's tensor, or
a root buffer with ``offload_buffers=True``) is placed on the main device rather than left on the meta device.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from packaging.version import Version
from torch import nn

from lightning_accel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_layerwise_casting_hooks,
)
from lightning_accel.utils.environment import parse_flag_from_env
from lightning_accel.utils.modeling import (
    check_device_map,
    find_tied_parameters,
    load_checkpoint_in_model,
    retie_parameters,
)

# Importable from here, as from ``accelerate.big_modeling`` (which imports them).
from lightning_accel.utils.modeling import get_balanced_memory as get_balanced_memory
from lightning_accel.utils.modeling import infer_auto_device_map as infer_auto_device_map
from lightning_accel.utils.modeling.device_map import DEVICE_MAP_STRATEGIES, strategy_device_map
from lightning_accel.utils.modeling.sizes import DtypeLike
from lightning_accel.utils.modeling.tensors import (
    DeviceLike,
    TiedParamsMap,
    resolve_device,
    set_module_tensor_to_device,
)
from lightning_accel.utils.offload import OffloadedWeightsLoader, extract_submodules_state_dict, offload_state_dict

__all__ = [
    "attach_layerwise_casting_hooks",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
]

logger = logging.getLogger(__name__)

_OFFLOAD_INDEX = "index.json"


def _include_buffers(include_buffers: bool | None) -> bool:
    if include_buffers is not None:
        return include_buffers
    return parse_flag_from_env("ACCELERATE_INIT_INCLUDE_BUFFERS", False)


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models on the meta device inside the block: parameters take no memory (and have no values).

    Load weights into such a model with :func:`load_checkpoint_and_dispatch` (or
    :func:`~lightning_accel.utils.modeling.load_checkpoint_in_model`).

    Args:
        include_buffers: Put the buffers on the meta device too (default: the ``ACCELERATE_INIT_INCLUDE_BUFFERS``
            environment variable, else ``False``).

    Example:
        >>> with init_empty_weights():
        ...     model = nn.Sequential(*[nn.Linear(10000, 10000) for _ in range(1000)])  # 100B parameters, no RAM

    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


def _moved_parameter(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """``param`` on ``device``, of its own class, with its attributes (transformers' init marker included)."""
    attributes = dict(param.__dict__)
    hf_initialized = attributes.pop("_is_hf_initialized", None)
    data = param.data.to(device)
    if type(param) is nn.Parameter:
        moved = nn.Parameter(data, requires_grad=param.requires_grad)
        moved.__dict__.update(attributes)
    else:  # subclasses (bitsandbytes' for one) take their attributes as constructor arguments
        moved = type(param)(data, requires_grad=param.requires_grad, **attributes)
    if hf_initialized is not None:
        moved._is_hf_initialized = hf_initialized  # type: ignore[attr-defined]
    return moved


@contextmanager
def init_on_device(device: DeviceLike, include_buffers: bool | None = None) -> Iterator[None]:
    """Build models with their parameters (and optionally buffers) on ``device`` inside the block.

    Args:
        device: Where parameters are created.
        include_buffers: Buffers too (default: the ``ACCELERATE_INIT_INCLUDE_BUFFERS`` environment variable, else
            ``False``); then every tensor created in the block is created there (torch's device context).

    """
    target = resolve_device(device)
    if _include_buffers(include_buffers):
        with target:
            yield
        return

    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already there is kept as is, so weights tied in a constructor stay tied.
        if param is not None and param.device != target:
            module._parameters[name] = _moved_parameter(module._parameters[name], target)  # type: ignore[arg-type]

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _first_parameter_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    if param is None:
        raise ValueError(f"{type(model).__name__} has no parameters to take an execution device from; pass one.")
    return param.device


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep the model's weights in CPU memory, loading each layer's onto the execution device for its call only.

    One copy of the weights is kept (the state dict); the model itself holds meta tensors between calls.

    Args:
        model: The model (changed in place).
        execution_device: Where ``forward`` runs (default: the device of the model's first parameter).
        offload_buffers: Offload the buffers too (otherwise they stay on the execution device).
        state_dict: The CPU copy of the weights (default: the model's state dict, on the CPU).
        preload_module_classes: Class names whose instances load all their submodules' weights at the start of
            their ``forward`` (for modules that use a child's weights without calling the child).

    Returns:
        ``model``.

    """
    _check_execution_device(execution_device)
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    return _attach_offload_hooks(model, execution_device, offload_buffers, state_dict, preload_module_classes)


def _check_execution_device(device: DeviceLike | None) -> None:
    """Refuse a device this machine lacks before anything is copied or written (not at the first forward)."""
    if device is not None:
        resolve_device(device)


def _attach_offload_hooks(
    model: nn.Module,
    execution_device: DeviceLike | None,
    offload_buffers: bool,
    weights_map: Mapping[str, torch.Tensor],
    preload_module_classes: list[str] | None,
) -> nn.Module:
    """The hooks of :func:`cpu_offload` and :func:`disk_offload`: each layer's weights read from ``weights_map``."""
    if execution_device is None:
        execution_device = _first_parameter_device(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until it runs; it then stays on ``execution_device`` until offloaded again.

    For pipelines running models in turn: each model's hook is passed to the next one as ``prev_module_hook``, so
    running a model sends the previous one back to the CPU; the last one is offloaded by calling its hook's
    ``offload()``.

    Args:
        model: The model (changed in place).
        execution_device: Where it runs (default: the machine's accelerator, else the CPU).
        prev_module_hook: The previous model's hook, offloaded when this model runs.

    Returns:
        ``model`` and its :class:`~lightning_accel.hooks.UserCpuOffloadHook`.

    """
    _check_execution_device(execution_device)
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _has_offload_index(folder: str | os.PathLike[str]) -> bool:
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, _OFFLOAD_INDEX))


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep the model's weights in memory-mapped files, loading each layer's onto the execution device for its call.

    The files (Accelerate's ``.dat`` + ``index.json`` layout) are read lazily, so the weights need not fit in RAM.

    Args:
        model: The model (changed in place).
        offload_dir: The folder holding the weights; written from the model unless it already has an ``index.json``.
        execution_device: Where ``forward`` runs (default: the device of the model's first parameter).
        offload_buffers: Offload the buffers too.
        preload_module_classes: See :func:`cpu_offload`.

    Returns:
        ``model``.

    """
    _check_execution_device(execution_device)
    if not _has_offload_index(offload_dir):
        offload_state_dict(offload_dir, model.state_dict())
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    return _attach_offload_hooks(model, execution_device, offload_buffers, weights_map, preload_module_classes)


def _main_device(devices: list[DeviceLike]) -> DeviceLike:
    """The device offloaded blocks run on: the lowest accelerator index, else the first other device, else the CPU."""
    indices = sorted(device for device in devices if isinstance(device, int))
    others = [device for device in devices if not isinstance(device, int) and device not in ("cpu", "disk")]
    return indices[0] if indices else others[0] if others else "cpu"


def _needs_hooks_for_bitsandbytes(model: nn.Module) -> bool:
    """Bitsandbytes models that ``.to()`` cannot move (8-bit before 0.48, 4-bit before 0.43.2) always get hooks."""
    if getattr(model, "quantization_method", "bitsandbytes") != "bitsandbytes":
        return False
    in_8bit, in_4bit = getattr(model, "is_loaded_in_8bit", False), getattr(model, "is_loaded_in_4bit", False)
    if not (in_8bit or in_4bit):
        return False
    try:
        version = Version(importlib.metadata.version("bitsandbytes"))
    except importlib.metadata.PackageNotFoundError:
        return True
    return (in_8bit and version < Version("0.48.0")) or (in_4bit and version < Version("0.43.2"))


def _tied_params_map(model: nn.Module, tied_params: list[list[str]]) -> TiedParamsMap:
    """An empty per-device record for each tied weight that has data (meta tensors all share pointer 0)."""
    tied: TiedParamsMap = {}
    for group in tied_params:
        for name in group:
            param = model.get_parameter(name)
            if param.device.type != "meta":
                tied[param.data_ptr()] = {}
    return tied


def _alias_tied_weights(weights_map: OffloadedWeightsLoader, tied_params: list[list[str]]) -> None:
    """Let every name of a tied weight read it when the checkpoint stored it under one name only (safetensors)."""
    for group in tied_params:
        stored = next((name for name in group if name in weights_map), None)
        for name in group if stored is not None else ():
            weights_map.alias(name, stored)  # type: ignore[arg-type]


def _offloaded_tensor_entries(
    model: nn.Module, device_map: Mapping[str, DeviceLike], offloaded: tuple[str, ...]
) -> list[str]:
    """Offloaded device-map entries naming a tensor, not a module (the direct tensors of a split module).

    Offload hooks serve whole modules, so these are placed on the main device instead (Accelerate left them on the
    meta device, and the forward failed).
    """
    modules = dict(model.named_modules())
    return [name for name, device in device_map.items() if device in offloaded and name not in modules]


def _guard_moves(model: nn.Module) -> None:
    """Warn when a dispatched model is moved, and refuse it when some of its weights are offloaded."""

    def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            moves = method.__name__ != "to" or torch._C._nn._parse_to(*args, **kwargs)[0] is not None
            if moves:
                logger.warning("You shouldn't move a model that is dispatched using accelerate hooks.")
            if any(param.device.type == "meta" for param in model.parameters()):
                raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk.")
            return method(*args, **kwargs)

        return wrapper

    model.to = guarded(model.to)  # type: ignore[method-assign]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    kind = accelerator.type if accelerator is not None else "cuda"
    if callable(getattr(model, kind, None)):
        setattr(model, kind, guarded(getattr(model, kind)))


def _check_devices_exist(devices: list[DeviceLike | None]) -> None:
    """Resolve every device a map names (``"disk"`` aside), so a missing one fails before anything moves."""
    for device in dict.fromkeys(devices):
        if device not in ("disk", None):
            resolve_device(device)


def _offload_disk_blocks(
    model: nn.Module,
    device_map: Mapping[str, DeviceLike],
    offload_dir: str | os.PathLike[str] | None,
    offload_index: Mapping[str, Any] | None,
) -> list[str]:
    """The map's ``"disk"`` blocks, their weights written to ``offload_dir`` unless an index already holds them.

    Raises:
        ValueError: For ``"disk"`` blocks with neither ``offload_dir`` nor ``offload_index``.

    """
    disk_blocks = [name for name, device in device_map.items() if device == "disk"]
    if disk_blocks and offload_dir is None and offload_index is None:
        raise ValueError(
            "We need an `offload_dir` to dispatch this model according to this `device_map`, the following submodules "
            f"need to be offloaded: {', '.join(disk_blocks)}."
        )
    if disk_blocks and offload_index is None and not _has_offload_index(offload_dir):  # type: ignore[arg-type]
        offload_state_dict(offload_dir, extract_submodules_state_dict(model.state_dict(), disk_blocks))  # type: ignore[arg-type]
    return disk_blocks


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, DeviceLike],
    main_device: DeviceLike | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model`` as ``device_map`` says and attach the hooks that run it across those devices.

    Blocks on an accelerator are moved there; ``"cpu"`` and ``"disk"`` blocks stay offloaded (in CPU memory or in
    ``offload_dir``) and run on ``main_device``, their weights loaded for each call. With a single device (and no
    ``force_hooks``), the model is simply moved there.

    Args:
        model: The model (changed in place); ``model.hf_device_map`` records the map.
        device_map: Module names to devices (``int`` accelerator indices, device strings, ``"cpu"``, ``"disk"``).
        main_device: Where offloaded blocks run (default: the first accelerator of the map, else the CPU).
        state_dict: The CPU blocks' weights (default: taken from the model).
        offload_dir: The folder of the ``"disk"`` blocks' weights (written from the model unless it has an
            ``index.json``).
        offload_index: Weight names to their offloaded location, instead of ``offload_dir``'s index.
        offload_buffers: Offload the buffers of offloaded blocks too.
        skip_keys: Keyword arguments (and output keys) left where they are.
        preload_module_classes: See :func:`cpu_offload`.
        force_hooks: Attach the hooks even when the map has a single device.

    Raises:
        ValueError: When the map names something the model lacks or a device this machine lacks, misses some of the
            model's tensors, or has ``"disk"`` blocks but no folder or index.

    """
    check_device_map(model, device_map)
    _check_devices_exist([*device_map.values(), main_device])
    force_hooks = force_hooks or _needs_hooks_for_bitsandbytes(model)
    devices = list(dict.fromkeys(device_map.values()))
    if len(devices) == 1 and "disk" not in devices and not force_hooks:
        model.to(resolve_device(devices[0]))
        model.hf_device_map = dict(device_map)  # type: ignore[assignment]
        return model

    main = main_device if main_device is not None else _main_device(devices)
    if main != "cpu" and state_dict is None:
        cpu_blocks = [name for name, device in device_map.items() if device == "cpu"]
        if cpu_blocks:
            state_dict = extract_submodules_state_dict(model.state_dict(), cpu_blocks)
    disk_blocks = _offload_disk_blocks(model, device_map, offload_dir, offload_index)

    # With the main device the CPU (or MPS, which shares its memory), CPU blocks need no offloading.
    offloaded = ("disk",) if main in ("cpu", "mps") else ("cpu", "disk")
    execution_device = {name: main if device in ("cpu", "disk") else device for name, device in device_map.items()}
    execution_device[""] = main
    offload = {name: device in offloaded for name, device in device_map.items()}
    save_folder = offload_dir if disk_blocks else None
    weights_map = None
    tied_params = find_tied_parameters(model)
    if state_dict is not None or save_folder is not None or offload_index is not None:
        weights_map = OffloadedWeightsLoader(
            state_dict=state_dict,
            save_folder=save_folder,
            index=offload_index,
            device=main if offload_index is not None else None,
        )
        _alias_tied_weights(weights_map, tied_params)
        for name in _offloaded_tensor_entries(model, device_map, offloaded):
            execution_device[name], offload[name] = main, False
            set_module_tensor_to_device(model, name, main, value=weights_map.get(name))
    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution_device,
        offload=offload,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=_tied_params_map(model, tied_params),
    )
    places = sorted({str(device) for device in device_map.values() if device in ("cpu", "disk")})
    if places:
        logger.warning(
            f"Some parameters are on the meta device because they were offloaded to the {' and '.join(places)}."
        )
    retie_parameters(model, tied_params)  # attaching hooks replaced some tied parameters
    _guard_moves(model)
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, DeviceLike] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: DtypeLike | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    weights_only: bool = True,
) -> nn.Module:
    """Load a (possibly sharded) checkpoint into ``model`` across devices and attach the hooks to run it.

    Args:
        model: The model (typically built under :func:`init_empty_weights`).
        checkpoint: A checkpoint file, a sharded checkpoint's ``.index.json``, or a folder holding either.
        device_map: A map of module names to devices, or how to compute one: ``"auto"``/``"balanced"`` (spread evenly
            over the accelerators), ``"balanced_low_0"`` (as little as possible on accelerator 0) or ``"sequential"``
            (fill each device in turn). ``None`` loads the checkpoint without dispatching.
        max_memory: Budget per device for a computed map (default: the free memory of each).
        no_split_module_classes: Class names of modules never split across devices.
        offload_folder: Where ``"disk"`` weights are written.
        offload_buffers: Offload the buffers of offloaded blocks too.
        dtype: Load floating-point weights in this dtype.
        offload_state_dict: Keep the CPU part on disk while loading (default: when the map has ``"disk"``).
        skip_keys: Keyword arguments (and output keys) left where they are.
        preload_module_classes: See :func:`cpu_offload`.
        force_hooks: Attach the hooks even when the map has a single device.
        strict: Refuse checkpoint tensors the model does not have.
        full_state_dict: Without a device map, the checkpoint is a full state dict.
        broadcast_from_rank0: Without a device map, rank 0 reads the checkpoint and broadcasts it.
        weights_only: ``False`` unpickles trusted ``torch.save`` files in full, with a warning naming each file.

    Returns:
        ``model``.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a ``torch.save`` file.
        ValueError: For a ``device_map`` string other than those above, or an index naming a shard outside its
            folder.

    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                "If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or "
                f"'sequential' (got {device_map!r})."
            )
        device_map = strategy_device_map(
            model,
            device_map,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
        )
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=offload_state_dict,
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
        weights_only=weights_only,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def _refuse_recurrent_layers_under_sequence_parallelism(model: Any) -> None:
    """Refuse, under sequence parallelism, models with layers carrying a state along the sequence (linear attention).

    Ulysses-style sequence parallelism gathers the whole sequence around attention, which ordinary attention does not
    notice; a linear-attention layer computes its recurrence in the model's own code, so each rank would restart it
    from zero on its shard and train on wrong gradients without failing.

    Raises:
        ValueError: Naming the recurrent layer types of ``model.config.layer_types``.

    """
    config: Any = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    recurrent = sorted({kind for kind in getattr(config, "layer_types", None) or [] if "linear_attention" in kind})
    if recurrent:
        raise ValueError(
            f"Sequence parallelism does not support attention layers of type {recurrent} (model "
            f"{type(model).__name__}): they carry a recurrent state along the sequence that sharding it would restart "
            "on every rank, giving wrong gradients. Use a full-attention model, or disable sequence parallelism."
        )
