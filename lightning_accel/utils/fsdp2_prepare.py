"""Accelerate's FSDP2 helpers: wrapping a model with ``fully_shard`` as ``Accelerator.prepare`` does, and its parts.

``fsdp2_prepare_model(accelerator, model)`` shards a model in place the way Accelerate 1.15 does: each module the
auto-wrap policy picks (children before parents), the input embedding, the tail (final norm and output embedding,
without resharding after forward), then the root; with ``cpu_ram_efficient_loading`` the weights are moved to the
meta device first and process 0's are broadcast into the shards. The ``accelerator`` is anything with a ``state``
(or itself) holding ``fsdp_plugin``, and ``mixed_precision``, ``device`` and ``is_main_process``, as Accelerate's
functions read them; the plugin is this package's :class:`~lightning_accel.utils.FullyShardedDataParallelPlugin` or
Accelerate's.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_accel.logging import get_logger
from lightning_accel.utils.modeling_tensors import get_non_persistent_buffers
from lightning_accel.utils.other import get_module_children_bottom_up, is_compiled_module
from lightning_accel.utils.versions import is_torch_version

__all__ = [
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
]

logger = get_logger(__name__)


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type[torch.nn.Module] | None:
    """The class named ``name`` of ``module`` or of a module below it (depth first), ``None`` if there is none."""
    if module.__class__.__name__ == name:
        return module.__class__
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None


def _plugin(accelerator: Any) -> Any:
    """The FSDP plugin of ``accelerator`` (``accelerator.state.fsdp_plugin`` as in Accelerate, or its own)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return plugin if plugin is not None else accelerator.fsdp_plugin


def _wrap_function(fsdp2_plugin: Any, model: torch.nn.Module) -> Any:
    """The plugin's auto-wrap policy as a torch policy callable (or ``None``), whichever plugin it is."""
    if hasattr(fsdp2_plugin, "build_auto_wrap_policy"):
        return fsdp2_plugin.build_auto_wrap_policy(model)
    return fsdp2_plugin.auto_wrap_policy  # Accelerate's plugin holds torch's policy function (or a partial of it)


def fsdp2_prepare_auto_wrap_policy(
    fsdp2_plugin: Any, model: torch.nn.Module
) -> Callable[[torch.nn.Module], bool] | None:
    """The plugin's auto-wrap policy as FSDP2 applies it: a ``module -> bool`` predicate, or ``None``.

    Transformer-based wrapping picks the modules of the classes named by ``transformer_cls_names_to_wrap`` (else the
    model's ``_no_split_modules``), looking through activation checkpointing's wrapper; size-based wrapping picks the
    modules holding more than ``min_num_params`` parameters, except ``ModuleList``/``ModuleDict`` containers (as
    torch's FSDP1 size policy does: ``fully_shard`` refuses modules without ``forward``, and Accelerate's FSDP2 policy
    fails on them).

    Raises:
        ValueError: If a class name to wrap is not found in ``model``.

    """
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    function = _wrap_function(fsdp2_plugin, model)
    if isinstance(function, functools.partial):
        function = function.func
    if function is transformer_auto_wrap_policy:
        names = list(getattr(model, "_no_split_modules", None) or [])
        if fsdp2_plugin.transformer_cls_names_to_wrap is not None:
            names = fsdp2_plugin.transformer_cls_names_to_wrap
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        classes = set()
        for name in names:
            found = get_module_class_from_name(model, name)
            if found is None:
                raise ValueError(f"Could not find the transformer layer class {name} in the model.")
            classes.add(found)

        def transformer_policy(module: torch.nn.Module) -> bool:
            if not classes:
                return False
            module = getattr(module, "_checkpoint_wrapped_module", module)
            return isinstance(module, tuple(classes))

        return transformer_policy
    if function is size_based_auto_wrap_policy:
        minimum = fsdp2_plugin.min_num_params or 0

        def size_policy(module: torch.nn.Module) -> bool:
            if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # no forward: fully_shard refuses them
                return False
            return sum(p.numel() for p in module.parameters()) > minimum

        return size_policy
    return None


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


def _fsdp2_kwargs(accelerator: Any, plugin: Any, model: torch.nn.Module) -> dict[str, Any]:
    """``fully_shard`` arguments from the plugin (either kind) and the accelerator's mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if hasattr(plugin, "torch_cpu_offload"):  # this package's plugin: torch objects on demand
        offload, precision = plugin.torch_cpu_offload(), plugin.torch_mixed_precision()
        reshard = True if plugin.reshard_after_forward is None else plugin.reshard_after_forward
    else:
        offload, precision, reshard = plugin.cpu_offload, plugin.mixed_precision_policy, plugin.reshard_after_forward
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs: dict[str, Any] = {
        "reshard_after_forward": reshard,
        "offload_policy": offload,
        "mp_policy": precision or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    if is_torch_version(">=", "2.7.0") and plugin.ignored_modules is not None:
        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    return kwargs


def _exclude_frozen_4bit(accelerator: Any, model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Keep non-floating frozen bitsandbytes 4-bit weights out of the shards; whether the model has 4-bit weights."""
    has_4bit = False
    frozen: set[torch.nn.Parameter] = set()
    for param in model.parameters():
        if param.__class__.__name__ == "Params4bit":
            has_4bit = True
            if not param.requires_grad and not param.is_floating_point() and not param.is_complex():
                frozen.add(param)
    if frozen and is_torch_version(">=", "2.7.0"):
        kwargs["ignored_params"] = set(kwargs.get("ignored_params", set())) | frozen
        if accelerator.is_main_process:
            warnings.warn(
                f"Found {len(frozen)} non-floating frozen Params4bit. Excluding from FSDP2 sharding to prevent "
                "quant_state corruption. To enable memory-efficient sharding of 4-bit weights, set "
                "bnb_4bit_quant_storage to a floating dtype (e.g. bf16).",
                stacklevel=3,
            )
    return has_4bit


def _upcast_trainable(accelerator: Any, model: torch.nn.Module) -> None:
    """With mixed precision, FSDP2 needs fp32 master weights: trainable low-precision parameters are upcast."""
    upcast = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            upcast.append(name)
            param.data = param.data.to(torch.float32)
    if upcast and accelerator.is_main_process:
        logger.info(f"FSDP upcast {len(upcast)} low-precision parameters to fp32 (mixed_precision != 'no'): {upcast}")


def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2's ``fully_shard``, as Accelerate's ``prepare`` does; returns it.

    A model already sharded (or a compiled sharded one) is returned as it is.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    fully_shard = _fully_shard()

    if isinstance(model, FSDPModule) or (is_compiled_module(model) and isinstance(model._orig_mod, FSDPModule)):
        return model
    plugin = _plugin(accelerator)
    if hasattr(plugin, "set_auto_wrap_policy"):  # Accelerate's plugin resolves its policy for the model first
        plugin.set_auto_wrap_policy(model)
    kwargs = _fsdp2_kwargs(accelerator, plugin, model)
    has_4bit = _exclude_frozen_4bit(accelerator, model, kwargs)
    if str(getattr(accelerator, "mixed_precision", "no")) != "no" and not has_4bit:
        _upcast_trainable(accelerator, model)
    original = model.state_dict()
    efficient = bool(plugin.cpu_ram_efficient_loading) and not has_4bit
    buffers: dict[str, torch.Tensor] = {}
    if efficient:  # shard on the meta device, then broadcast process 0's weights into the shards
        names = get_non_persistent_buffers(model, recurse=True, fqns=True)
        buffers = copy.deepcopy({k: v for k, v in model.named_buffers() if k in names})
        model = model.to(torch.device("meta"))
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # type: ignore[operator]  # a transformers model's method
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and not isinstance(module, FSDPModule):  # type: ignore[arg-type]
                fully_shard(module, **kwargs)
    _shard_embeddings_and_tail(model, kwargs)
    if not isinstance(model, FSDPModule):
        fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    if efficient:
        fsdp2_load_full_state_dict(
            accelerator, model, original, cpu_offload=isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
        )
        for fqn, buffer in buffers.items():
            parent_name, _, local = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            parent.register_buffer(local, buffer.to(accelerator.device), persistent=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # type: ignore[operator]  # a transformers model's method
    return model


def _shard_embeddings_and_tail(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Shard the input embedding alone, and the final norm with the output embedding (and a tied input one).

    The tail is not resharded after forward, as Accelerate 1.15 groups them.
    """
    from torch.distributed.fsdp import FSDPModule

    fully_shard = _fully_shard()
    input_embed = getattr(model, "get_input_embeddings", lambda: None)()
    output_embed = getattr(model, "get_output_embeddings", lambda: None)()
    input_weight, output_weight = getattr(input_embed, "weight", None), getattr(output_embed, "weight", None)
    tied = input_weight is not None and input_weight is output_weight
    if not tied and input_embed is not None and not isinstance(input_embed, FSDPModule):
        fully_shard(input_embed, **kwargs)
    final_norm = _find_final_norm(model)
    candidates = (final_norm, input_embed, output_embed) if tied else (final_norm, output_embed)
    tail = [m for m in candidates if m is not None and not isinstance(m, FSDPModule)]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})


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
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    meta_state = model.state_dict()
    sharded: dict[str, Any] = {}

    def dtype_and_layout(name: str, empty: torch.Tensor) -> tuple[bool, torch.dtype | None]:
        try:
            old = model.get_parameter_or_buffer(name)  # type: ignore[operator]  # torch 2.7's method
        except AttributeError:  # LoRA and the like: not a parameter of any module
            base, _, local = name.rpartition(".")
            old = getattr(model.get_submodule(base), local)
        float8 = getattr(torch, "float8_e4m3fn", None)
        cast = old.dtype if empty.dtype.is_floating_point and empty.dtype != float8 else None
        return old is not None and old.is_contiguous(), cast

    for name, sharded_param in meta_state.items():
        mesh = sharded_param.device_mesh
        if accelerator.is_main_process:
            if name not in full_sd:
                raise KeyError(
                    f"Parameter '{name}' found in sharded model state dict but missing from full state dict. Full "
                    f"state dict has {len(full_sd)} keys, sharded has {len(meta_state)} keys."
                )
            full: Any = full_sd[name].detach().to(mesh.device_type)
            if isinstance(full, DTensor):
                full = full.to_local()
        else:
            full = torch.empty(sharded_param.size(), device=mesh.device_type, dtype=sharded_param.dtype)
        dist.broadcast(full, src=0, group=dist.group.WORLD)
        tensor: Any = distribute_tensor(full, mesh, sharded_param.placements)
        contiguous, cast = dtype_and_layout(name, full)
        if cast is not None:
            tensor = tensor.to(dtype=cast)
        if contiguous:
            tensor = tensor.contiguous()
        sharded[name] = tensor.to("cpu") if cpu_offload else tensor
    model.load_state_dict(sharded, assign=True)
    return model


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


def fsdp2_apply_ac(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap the modules the auto-wrap policy picks in activation checkpointing (CPU offload when asked), in place.

    Returns:
        The model.

    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    plugin = _plugin(accelerator)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return model
    for name, layer in get_module_children_bottom_up(model, return_fqns=True)[:-1]:  # type: ignore[misc]
        if policy(layer):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            if plugin.activation_checkpointing_offload:
                wrapped = offload_wrapper(wrapped)
            model.set_submodule(name, wrapped)
    return model


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
