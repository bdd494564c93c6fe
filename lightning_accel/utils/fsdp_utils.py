"""Accelerate's ``accelerate.utils.fsdp_utils``: FSDP2 application, FSDP checkpoints, and merging shards.

:func:`apply_fsdp2` shards a module with FSDP2's ``fully_shard`` the way Accelerate 1.15 groups it, and
:func:`apply_ac` wraps its blocks in activation checkpointing; ``acc_fsdp``, ``acc_parallel`` and Accelerate's
``fsdp2_prepare_model(accelerator, model)`` / ``fsdp2_apply_ac(accelerator, model)`` (thin wrappers here) all call
them.

``save_state`` under FSDP with ``SHARDED_STATE_DICT`` writes ``pytorch_model_fsdp_{i}/`` (and ``optimizer_{i}/``) as
``torch.distributed.checkpoint`` directories, one shard per process. :func:`merge_fsdp_weights` turns such a directory
into ``model.safetensors`` (or ``pytorch_model.bin``) that loads without FSDP or a process group. The model and
optimizer checkpoint functions (``save_fsdp_model``, ...) are thin wrappers here, Accelerate's path, over the one FSDP
layout in :mod:`lightning_accel.checkpoint.fsdp_layout` (a layer up, so imported when called).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState
from lightning_accel.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from lightning_accel.utils.modeling.checkpoint import read_sharded_entries
from lightning_accel.utils.modeling.tensors import get_non_persistent_buffers
from lightning_accel.utils.operations import _is_main_process
from lightning_accel.utils.other import get_module_children_bottom_up, is_compiled_module, save
from lightning_accel.utils.versions import is_torch_version

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "apply_ac",
    "apply_fsdp2",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_auto_wrap_policy",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_module_class_from_name",
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

logger = get_logger(__name__)

_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes next to its shards


def enable_fsdp_ram_efficient_loading() -> None:
    """Tell ``transformers`` to load pretrained weights on process 0 only under FSDP (the others get empty ones).

    Sets ``FSDP_CPU_RAM_EFFICIENT_LOADING=True``, and ``ACCELERATE_USE_FSDP=True`` unless it is set: what
    ``transformers.modeling_utils.is_fsdp_enabled`` reads. Accelerate's function, writing ``os.environ``.
    """
    if "ACCELERATE_USE_FSDP" not in os.environ:
        os.environ["ACCELERATE_USE_FSDP"] = "True"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo :func:`enable_fsdp_ram_efficient_loading`'s loading rule: ``FSDP_CPU_RAM_EFFICIENT_LOADING=False``."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def _check_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Fail unless ``checkpoint_dir`` is a ``torch.distributed.checkpoint`` directory, pointing at one inside it.

    Raises:
        ValueError: Naming the model/optimizer directories found inside, if any.

    """
    if (checkpoint_dir / _METADATA).is_file():
        return
    inside = [
        str(checkpoint_dir / name)
        for name in (f"{FSDP_MODEL_NAME}_0", f"{OPTIMIZER_NAME}_0")
        if (checkpoint_dir / name / _METADATA).is_file()
    ]
    hint = f"; it holds {' and '.join(inside)}: pass one of those instead" if inside else ""
    raise ValueError(
        f"{checkpoint_dir} is not a sharded FSDP checkpoint (no {_METADATA} file from torch.distributed.checkpoint)"
        f"{hint}"
    )


def _load_merged(checkpoint_dir: Path) -> dict[str, Any]:
    """Read every shard of a ``torch.distributed.checkpoint`` directory into one state dict, in this process."""
    state = read_sharded_entries(checkpoint_dir)
    if len(state) == 1:  # save_state stores {"model": <state dict>} (or {"optimizer": ...})
        (only,) = state.values()
        if isinstance(only, dict):
            return only
    return state


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge a sharded FSDP checkpoint directory into ``output_path/model.safetensors`` (or ``pytorch_model.bin``).

    The main process does the work (on CPU, holding the whole state dict in memory); the others wait for it.

    Args:
        checkpoint_dir: A ``pytorch_model_fsdp_{i}`` (or ``optimizer_{i}``) directory written by ``save_state`` with
            ``SHARDED_STATE_DICT``.
        output_path: The folder to write to (created if missing).
        safe_serialization: Write ``model.safetensors``; ``False`` writes ``pytorch_model.bin`` with ``torch.save``
            (needed for an optimizer checkpoint, whose nested state safetensors cannot hold).
        remove_checkpoint_dir: Delete ``checkpoint_dir`` after a successful merge.

    Raises:
        ValueError: If ``checkpoint_dir`` is not a ``torch.distributed.checkpoint`` directory, or torch is older
            than 2.3.
        TypeError: If ``safe_serialization`` is asked for a state that is not a flat dict of tensors.

    """
    if not is_torch_version(">=", "2.3.0"):
        raise ValueError("merge_fsdp_weights needs torch 2.3 or newer (torch.distributed.checkpoint.format_utils)")
    source = Path(checkpoint_dir)
    _check_checkpoint_dir(source)
    state = PartialState()
    if state.is_main_process:
        target = Path(output_path)
        target.mkdir(parents=True, exist_ok=True)
        weights = _load_merged(source)
        save(
            weights,
            target / (SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME),
            safe_serialization=safe_serialization,
        )
        if remove_checkpoint_dir:
            shutil.rmtree(source)
    state.wait_for_everyone()


class FSDPSettings(Protocol):
    """The fields of a ``FullyShardedDataParallelPlugin`` (this package's or Accelerate's) FSDP2 application reads."""

    auto_wrap_policy: Any
    transformer_cls_names_to_wrap: Any
    min_num_params: int | None
    reshard_after_forward: Any
    cpu_offload: Any
    mixed_precision_policy: Any
    ignored_modules: Any
    cpu_ram_efficient_loading: bool
    activation_checkpointing_offload: bool


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type[torch.nn.Module] | None:
    """The class named ``name`` of ``module`` or of a module below it (depth first), ``None`` if there is none."""
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None


def _wrap_function(plugin: FSDPSettings, model: torch.nn.Module) -> Any:
    """The plugin's auto-wrap policy as a torch policy callable (or ``None``), whichever plugin it is."""
    build = getattr(plugin, "build_auto_wrap_policy", None)
    if build is not None:
        return build(model)
    return plugin.auto_wrap_policy  # Accelerate's plugin holds torch's policy function (or a partial of it)


def fsdp2_prepare_auto_wrap_policy(
    fsdp2_plugin: FSDPSettings, model: torch.nn.Module
) -> Callable[[torch.nn.Module], bool] | None:
    """The plugin's auto-wrap policy as FSDP2 applies it: a ``module -> bool`` predicate, or ``None``.

    Transformer-based wrapping picks the modules of the classes named by ``transformer_cls_names_to_wrap`` (else the
    model's ``_no_split_modules``), looking through activation checkpointing's wrapper; size-based wrapping picks the
    modules holding more than ``min_num_params`` parameters, except ``ModuleList``/``ModuleDict`` containers (as
    torch's FSDP1 size policy does: ``fully_shard`` refuses modules without ``forward``, and Accelerate's FSDP2 policy
    fails on them). A policy callable of the user's own is asked about each module with torch's FSDP1 policy
    arguments (``module``, ``recurse=False``, ``nonwrapped_numel``: the module's parameter count); Accelerate
    ignores such a callable under FSDP2.

    Raises:
        ValueError: If a class name to wrap is not found in ``model``.

    """
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    function = _wrap_function(fsdp2_plugin, model)
    if function is None:
        return None
    base = function.func if isinstance(function, functools.partial) else function
    if base is transformer_auto_wrap_policy:
        return _transformer_policy(fsdp2_plugin, model)
    if base is size_based_auto_wrap_policy:
        return _size_policy(fsdp2_plugin.min_num_params or 0)
    return _custom_policy(function)


def _transformer_policy(plugin: FSDPSettings, model: torch.nn.Module) -> Callable[[torch.nn.Module], bool]:
    names = list(getattr(model, "_no_split_modules", None) or [])
    if plugin.transformer_cls_names_to_wrap is not None:
        names = plugin.transformer_cls_names_to_wrap
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    classes = set()
    for name in names:
        found = get_module_class_from_name(model, name)
        if found is None:
            raise ValueError(f"Could not find the transformer layer class {name} in the model.")
        classes.add(found)

    def transformer_policy(module: torch.nn.Module) -> bool:
        module = getattr(module, "_checkpoint_wrapped_module", module)
        return bool(classes) and isinstance(module, tuple(classes))

    return transformer_policy


def _size_policy(minimum: int) -> Callable[[torch.nn.Module], bool]:
    def size_policy(module: torch.nn.Module) -> bool:
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # no forward: fully_shard refuses them
            return False
        return sum(p.numel() for p in module.parameters()) > minimum

    return size_policy


def _custom_policy(function: Callable[..., Any]) -> Callable[[torch.nn.Module], bool]:
    def custom_policy(module: torch.nn.Module) -> bool:
        numel = sum(p.numel() for p in module.parameters())
        return bool(function(module=module, recurse=False, nonwrapped_numel=numel))

    return custom_policy


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module, device: Any
) -> set[torch.nn.Parameter]:
    """The parameters of ``modules``: modules, or a regex matched against ``model``'s module names.

    Modules matched by a regex are moved to ``device`` first, as in Accelerate.
    """
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        matched = []
        for name, module in model.named_modules():
            if pattern.fullmatch(name):
                module.to(device)
                matched.append(module)
        modules = matched
    return {p for module in modules for p in module.parameters()}


def _fully_shard() -> Any:
    """Return torch's ``fully_shard`` (typed loosely: its decorator hides its signature from type checkers)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _is_fsdp2(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or (is_compiled_module(model) and isinstance(model._orig_mod, FSDPModule))


def _mesh_device(mesh: DeviceMesh | None) -> torch.device:
    """The device ``fully_shard`` puts this process's shards on for ``mesh`` (``None``: torch's default mesh)."""
    if mesh is not None:
        device_type = mesh.device_type
    else:
        accelerator = torch.accelerator.current_accelerator()
        device_type = "cpu" if accelerator is None else accelerator.type
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def apply_fsdp2(
    module: torch.nn.Module,
    plugin: FSDPSettings,
    *,
    mesh: DeviceMesh | None,
    mp_policy: MixedPrecisionPolicy | None,
) -> torch.nn.Module:
    """Shard ``module`` in place with FSDP2's ``fully_shard``, grouped as Accelerate 1.15 groups it; returns it.

    The units, in order: each module the plugin's auto-wrap policy picks (children before parents), the input
    embedding alone, the tail (final norm and output embedding, with the input embedding when the weights are tied)
    kept gathered after forward, then the root with torch's default resharding. ``ignored_modules`` (and frozen
    non-floating bitsandbytes 4-bit weights) stay out of every unit. With ``cpu_ram_efficient_loading`` the module
    is sharded on the meta device and process 0's weights are broadcast into the shards, so every process ends with
    process 0's weights. A module already sharded (or a compiled sharded one) is returned as it is.

    Args:
        module: The model to shard.
        plugin: This package's ``FullyShardedDataParallelPlugin`` or Accelerate's (``fsdp_version=2``): auto-wrap
            policy, ``reshard_after_forward``, ``cpu_offload``, ``ignored_modules``, ``cpu_ram_efficient_loading``.
        mesh: The mesh of the shard dimensions (HSDP: replicate and shard); ``None`` is torch's default mesh over
            every process.
        mp_policy: FSDP2's mixed precision; ``None`` keeps the parameters' dtypes.

    Returns:
        ``module``, sharded.

    Raises:
        ValueError: If a class name of ``transformer_cls_names_to_wrap`` is not found in ``module``.

    """
    if _is_fsdp2(module):
        return module
    kwargs = _shard_kwargs(module, plugin, mesh, mp_policy)
    has_4bit = _exclude_frozen_4bit(module, kwargs)
    if plugin.cpu_ram_efficient_loading and not has_4bit:
        return _shard_from_process_zero(module, plugin, kwargs, _mesh_device(mesh))
    _shard_units(module, plugin, kwargs)
    return module


def _shard_kwargs(
    model: torch.nn.Module, plugin: FSDPSettings, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy | None
) -> dict[str, Any]:
    """``fully_shard`` arguments from the plugin (either kind)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch_offload = getattr(plugin, "torch_cpu_offload", None)
    offload = torch_offload() if torch_offload is not None else plugin.cpu_offload
    reshard = plugin.reshard_after_forward
    kwargs: dict[str, Any] = {
        "reshard_after_forward": True if reshard is None else reshard,
        "offload_policy": offload,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "mesh": mesh,
    }
    if is_torch_version(">=", "2.7.0") and plugin.ignored_modules is not None:
        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, _mesh_device(mesh))
    return kwargs


def _has_params4bit(model: torch.nn.Module) -> bool:
    return any(param.__class__.__name__ == "Params4bit" for param in model.parameters())


def _exclude_frozen_4bit(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Keep non-floating frozen bitsandbytes 4-bit weights out of the shards; whether the model has 4-bit weights."""
    frozen = {
        param
        for param in model.parameters()
        if param.__class__.__name__ == "Params4bit"
        and not param.requires_grad
        and not param.is_floating_point()
        and not param.is_complex()
    }
    if frozen and is_torch_version(">=", "2.7.0"):
        kwargs["ignored_params"] = set(kwargs.get("ignored_params", set())) | frozen
        if _is_main_process():
            warnings.warn(
                f"Found {len(frozen)} non-floating frozen Params4bit. Excluding from FSDP2 sharding to prevent "
                "quant_state corruption. To enable memory-efficient sharding of 4-bit weights, set "
                "bnb_4bit_quant_storage to a floating dtype (e.g. bf16).",
                stacklevel=4,
            )
    return _has_params4bit(model)


def _shard_units(model: torch.nn.Module, plugin: FSDPSettings, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` the policy's modules, the embeddings and tail, then the root."""
    from torch.distributed.fsdp import FSDPModule

    fully_shard = _fully_shard()
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and not isinstance(module, FSDPModule):  # type: ignore[arg-type]
                fully_shard(module, **kwargs)
    _shard_embeddings_and_tail(model, kwargs)
    if not isinstance(model, FSDPModule):
        # torch's default (None) keeps the root gathered between forward and backward: resharding it there only buys
        # an all-gather backward needs right away.
        fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def _shard_from_process_zero(
    model: torch.nn.Module, plugin: FSDPSettings, kwargs: dict[str, Any], device: torch.device
) -> torch.nn.Module:
    """Shard ``model`` on the meta device, then broadcast process 0's weights into the shards (in place)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    original = model.state_dict()
    names = get_non_persistent_buffers(model, recurse=True, fqns=True)
    buffers = copy.deepcopy({k: v for k, v in model.named_buffers() if k in names})
    model = model.to(torch.device("meta"))
    _retie(model)
    _shard_units(model, plugin, kwargs)
    offload = isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    _load_full_state_dict(model, original, is_main=_is_main_process(), cpu_offload=offload)
    for fqn, buffer in buffers.items():
        parent_name, _, local = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_buffer(local, buffer.to(device), persistent=False)
    _retie(model)
    return model


def _retie(model: torch.nn.Module) -> None:
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]  # a transformers model's method


def _find_final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last child of the base model whose class name holds ``Norm`` (``model.norm``, ``transformer.ln_f``...)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    found = None
    for _, module in base.named_children():
        if "Norm" in type(module).__name__:
            found = module
    return found


def _in_a_unit(module: torch.nn.Module | None) -> bool:
    """Whether ``module``'s parameters are already sharded: it, or a module holding it, is an FSDP2 unit."""
    from torch.distributed.tensor import DTensor

    return module is not None and any(isinstance(parameter, DTensor) for parameter in module.parameters())


def _shard_embeddings_and_tail(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Shard the input embedding alone, and the final norm with the output embedding (and a tied input one).

    The tail is not resharded after forward: backward starts with it. A module the auto-wrap policy already put in a
    unit (BERT's ``_no_split_modules`` name ``BertEmbeddings``, which holds the input embedding) stays there; HF
    accelerate 1.15 shards it a second time and ``fully_shard`` fails.
    """
    fully_shard = _fully_shard()
    input_embed = getattr(model, "get_input_embeddings", lambda: None)()
    output_embed = getattr(model, "get_output_embeddings", lambda: None)()
    input_weight, output_weight = getattr(input_embed, "weight", None), getattr(output_embed, "weight", None)
    tied = input_weight is not None and input_weight is output_weight
    if not tied and input_embed is not None and not _in_a_unit(input_embed):
        fully_shard(input_embed, **kwargs)
    final_norm = _find_final_norm(model)
    candidates = (final_norm, input_embed, output_embed) if tied else (final_norm, output_embed)
    tail = [m for m in candidates if m is not None and not _in_a_unit(m)]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})


def apply_ac(module: torch.nn.Module, plugin: FSDPSettings) -> torch.nn.Module:
    """Wrap the blocks the plugin's auto-wrap policy picks in activation checkpointing, in place; returns ``module``.

    Each block gets a non-reentrant ``checkpoint_wrapper``; with ``activation_checkpointing_offload`` an
    ``offload_wrapper`` around it also moves the inputs the checkpoint keeps to CPU memory. FSDP2's policy looks
    through the wrappers, so the same blocks become FSDP units afterwards.

    Raises:
        ValueError: If the plugin's auto-wrap policy picks nothing to checkpoint (no policy, or a transformer-based
            one without class names and without the model's ``_no_split_modules``).

    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    policy = fsdp2_prepare_auto_wrap_policy(plugin, module)
    named = cast("list[tuple[str, torch.nn.Module]]", get_module_children_bottom_up(module, return_fqns=True))
    blocks = [(name, m) for name, m in named[:-1] if policy is not None and policy(m)]
    if not blocks:
        raise ValueError(
            "activation_checkpointing=True needs the blocks to checkpoint, picked by the auto-wrap policy, but it picks"
            f" none in {type(module).__name__}: set FullyShardedDataParallelPlugin(auto_wrap_policy="
            "'transformer_based_wrap', transformer_cls_names_to_wrap=[...]) to their class names."
        )
    for name, block in blocks:
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        if plugin.activation_checkpointing_offload:
            wrapped = offload_wrapper(wrapped)
        module.set_submodule(name, wrapped)
    return module


def _plugin(accelerator: Any) -> FSDPSettings:
    """The FSDP plugin of ``accelerator`` (``accelerator.state.fsdp_plugin`` as in Accelerate, or its own)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return plugin if plugin is not None else accelerator.fsdp_plugin


def fsdp2_apply_ac(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Accelerate's name for :func:`apply_ac` with the accelerator's FSDP plugin; returns the model."""
    return apply_ac(model, _plugin(accelerator))


def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` in place as Accelerate's ``prepare`` does (:func:`apply_fsdp2`); returns it.

    The ``accelerator`` is anything with a ``state`` (or itself) holding ``fsdp_plugin``, and ``mixed_precision``
    (with mixed precision, trainable low-precision parameters are upcast to fp32 master weights first);
    ``torch_device_mesh`` and ``parallelism_config`` choose the mesh when present. The plugin is this package's or
    Accelerate's.
    """
    if _is_fsdp2(model):
        return model
    plugin = _plugin(accelerator)
    set_policy = getattr(plugin, "set_auto_wrap_policy", None)
    if set_policy is not None:  # Accelerate's plugin resolves its named policy for the model first
        set_policy(model)
    if str(getattr(accelerator, "mixed_precision", "no")) != "no" and not _has_params4bit(model):
        _upcast_trainable(model)
    torch_precision = getattr(plugin, "torch_mixed_precision", None)
    mp_policy = torch_precision() if torch_precision is not None else plugin.mixed_precision_policy
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    return apply_fsdp2(model, plugin, mesh=mesh, mp_policy=mp_policy)


def _upcast_trainable(model: torch.nn.Module) -> None:
    """With mixed precision, FSDP2 needs fp32 master weights: trainable low-precision parameters are upcast."""
    upcast = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            upcast.append(name)
            param.data = param.data.to(torch.float32)
    if upcast and _is_main_process():
        logger.info(f"FSDP upcast {len(upcast)} low-precision parameters to fp32 (mixed_precision != 'no'): {upcast}")


def fsdp2_load_full_state_dict(
    accelerator: Any, model: torch.nn.Module, full_sd: dict[str, Any], cpu_offload: bool = False
) -> torch.nn.Module:
    """Broadcast process 0's full state dict into the shards of ``model`` (on the meta device); in place, returned.

    Every process calls it; ``full_sd`` is read on process 0 only. Floating-point values are cast to the model's
    dtypes (float8 ones are kept).

    Args:
        accelerator: The accelerator (``is_main_process``).
        model: The sharded model, its parameters on the meta device (else memory doubles for a moment).
        full_sd: The full state dict (used on process 0).
        cpu_offload: Move the shards to CPU afterwards (for FSDP2's CPU offloading).

    Raises:
        KeyError: On process 0, if the model has an entry ``full_sd`` lacks.

    """
    return _load_full_state_dict(model, full_sd, is_main=bool(accelerator.is_main_process), cpu_offload=cpu_offload)


def _load_full_state_dict(
    model: torch.nn.Module, full_sd: dict[str, Any], *, is_main: bool, cpu_offload: bool
) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    meta_state = model.state_dict()
    sharded: dict[str, Any] = {}
    for name, sharded_param in meta_state.items():
        mesh = sharded_param.device_mesh
        full = _full_value(full_sd, name, len(meta_state), mesh.device_type) if is_main else None
        if full is None:
            full = torch.empty(sharded_param.size(), device=mesh.device_type, dtype=sharded_param.dtype)
        dist.broadcast(full, src=0, group=dist.group.WORLD)
        tensor: Any = distribute_tensor(full, mesh, sharded_param.placements)
        contiguous, cast = _layout_of(model, name, full)
        if cast is not None:
            tensor = tensor.to(dtype=cast)
        if contiguous:
            tensor = tensor.contiguous()
        sharded[name] = tensor.to("cpu") if cpu_offload else tensor
    model.load_state_dict(sharded, assign=True)
    return model


def _full_value(full_sd: dict[str, Any], name: str, count: int, device_type: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if name not in full_sd:
        raise KeyError(
            f"Parameter '{name}' found in sharded model state dict but missing from full state dict. Full "
            f"state dict has {len(full_sd)} keys, sharded has {count} keys."
        )
    full: Any = full_sd[name].detach().to(device_type)
    return full.to_local() if isinstance(full, DTensor) else full


def _layout_of(model: torch.nn.Module, name: str, full: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """Whether the model's tensor ``name`` is contiguous, and the dtype to cast a floating value to (float8 kept)."""
    try:
        old = model.get_parameter_or_buffer(name)  # type: ignore[operator]  # torch 2.7's method
    except AttributeError:  # LoRA and the like: not a parameter of any module
        base, _, local = name.rpartition(".")
        old = getattr(model.get_submodule(base), local)
    float8 = getattr(torch, "float8_e4m3fn", None)
    cast = old.dtype if full.dtype.is_floating_point and full.dtype != float8 else None
    return old is not None and old.is_contiguous(), cast


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict[Any, Any]) -> None:
    """Point ``optimizer``'s groups at the sharded parameters, in place (``mapping``: original ``data_ptr`` -> new).

    Raises:
        KeyError: If a parameter has no sharded counterpart (training would silently leave it unchanged).

    """
    try:
        for group in optimizer.param_groups:
            group["params"] = [mapping[p.data_ptr] for p in group["params"]]
    except KeyError:
        raise KeyError(
            "A parameter in the optimizer couldn't be switched to its sharded version. This breaks the training. "
            "Please raise an issue on GitHub."
        ) from None


def get_fsdp2_grad_scaler(**kwargs: Any) -> Any:
    """``torch.amp.GradScaler(**kwargs)``, the scaler FSDP2 takes."""
    from torch.amp.grad_scaler import GradScaler

    return GradScaler(**kwargs)


def fsdp2_canonicalize_names(named_params: dict[str, Any]) -> dict[str, Any]:
    """``named_params`` with activation checkpointing's and ``torch.compile``'s name parts removed."""
    named_params = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in named_params.items()}
    named_params = {k.removeprefix("_orig_mod."): v for k, v in named_params.items()}
    return {k.replace("._orig_mod", ""): v for k, v in named_params.items()}


def ensure_weights_retied(param_init_fn: Any, model: torch.nn.Module, device: torch.device) -> Any:
    """``param_init_fn``, made to re-tie the model's tied weights (``_tied_weights_keys``) after it materialises them.

    Without tied weights the function is returned unchanged. ``device`` is accepted for Accelerate's signature.
    """
    del device
    tied_names = getattr(model, "_tied_weights_keys", None)
    if not tied_names:
        return param_init_fn
    tied: dict[int, Any] = {}
    for name in tied_names:
        owner, _, local = name.rpartition(".")
        tied[id(getattr(model.get_submodule(owner), local))] = None

    def init_and_retie(module: torch.nn.Module) -> torch.nn.Module:
        to_tie: dict[int, list[str]] = defaultdict(list)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in tied:
                to_tie[id(param)].append(name)
        module = param_init_fn(module)
        for key, names in to_tie.items():
            for name in names:
                if tied[key] is None:
                    tied[key] = getattr(module, name)  # the first one seen is the one the others tie to
                else:
                    setattr(module, name, tied[key])
        return module

    return init_and_retie


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Write an FSDP model's weights to ``output_dir`` as Accelerate does (every process calls it).

    Args:
        fsdp_plugin: The FSDP plugin (its ``fsdp_version`` and ``state_dict_type`` choose the format), this
            package's or Accelerate's.
        accelerator: The accelerator (``num_processes``, ``process_index``).
        model: The FSDP-wrapped model (or the one ``Accelerator.prepare`` returned).
        output_dir: The folder (created if missing).
        model_index: The model's index, in the file names.
        adapter_only: For a PEFT model, the adapter's weights only.
        use_dcp: With ``SHARDED_STATE_DICT``, a ``torch.distributed.checkpoint`` directory; ``False`` writes one
            ``torch.save`` file per process (no collective; load it with ``use_dcp=False`` too).

    """
    from lightning_accel.checkpoint import fsdp_layout

    fsdp_layout.save_model(
        fsdp_layout.FSDPCall(fsdp_plugin, accelerator, model, output_dir, model_index, adapter_only, use_dcp)
    )


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    weights_only: bool = True,
) -> Any:
    """Load what :func:`save_fsdp_model` (or Accelerate's) wrote into an FSDP model; every process calls it.

    Every file is read weights-only unless ``weights_only=False`` (a trusted folder; it warns naming each file; FSDP1's
    ``LOCAL_STATE_DICT`` shards, which hold ``ShardedTensor`` objects, need it).

    With ``FULL_STATE_DICT`` and FSDP1, only process 0 reads the file when the model's states are synced from it
    (``sync_module_states``), as in Accelerate; with FSDP2 process 0 reads it and broadcasts.

    Returns:
        What the model's ``load_state_dict`` returned (``None`` on the processes that load nothing).

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
        ValueError: Under FSDP1 with ``FULL_STATE_DICT`` on a process other than 0 when ``model`` is not FSDP-wrapped
            and ``sync_module_states`` is off (that process would keep its own weights).

    """
    from lightning_accel.checkpoint import fsdp_layout

    return fsdp_layout.load_model(
        fsdp_layout.FSDPCall(
            fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, use_dcp, weights_only
        )
    )


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Write an FSDP optimizer's state (keyed by parameter name) to ``output_dir``; every process calls it.

    ``FULL_STATE_DICT``: ``optimizer.bin`` from process 0; otherwise ``optimizer_{i}/``
    (``torch.distributed.checkpoint``) or, with ``use_dcp=False``, ``optimizer_{i}_rank{r}.bin`` per process.
    """
    from lightning_accel.checkpoint import fsdp_layout

    fsdp_layout.save_optimizer(
        fsdp_layout.FSDPCall(fsdp_plugin, accelerator, model, output_dir, optimizer_index, use_dcp=use_dcp), optimizer
    )


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
    *,
    weights_only: bool = True,
) -> None:
    """Load what :func:`save_fsdp_optimizer` (or Accelerate's) wrote into the optimizer; every process calls it.

    Every file is read weights-only unless ``weights_only=False`` (a trusted folder; it warns naming each file).

    ``adapter_only`` is accepted for Accelerate's signature and unused, as there.
    """
    from lightning_accel.checkpoint import fsdp_layout

    del adapter_only
    fsdp_layout.load_optimizer(
        fsdp_layout.FSDPCall(
            fsdp_plugin, accelerator, model, input_dir, optimizer_index, use_dcp=use_dcp, weights_only=weights_only
        ),
        optimizer,
    )
