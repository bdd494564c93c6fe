"""Optimizers built before sharding: point their param groups at the parameters FSDP leaves in the model.

An Accelerate script builds the optimizer from the unsharded model and prepares both in one call
(``accelerator.prepare(model, optimizer, ...)``). FSDP2 replaces every parameter by a sharded ``DTensor`` one, FSDP1
with ``use_orig_params=False`` by flat parameters, so such an optimizer would update tensors the model no longer uses.
:func:`optimizer_parameter_names` records, before sharding, the name in the model of every parameter the optimizers
hold; :func:`repoint_optimizers` then puts the sharded parameter of that name in its place. An optimizer set up on
its own must already hold the sharded parameters (:func:`check_sharded_parameters`). Param-group settings
(``lr``, ``weight_decay``, ...) stay as they are, and so do the group lists themselves (replaced in place), so whatever
holds a reference to a group's list sees the sharded parameters too.

A flat parameter (FSDP1, ``use_orig_params=False``) holds several of the model's parameters, so it replaces them only
when one param group holds all of them; otherwise the optimizer cannot keep its groups apart and
:func:`repoint_optimizers` refuses. HF accelerate leaves such an optimizer on the unsharded tensors, which then never
get a gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

# Names of the modules FSDP1 and activation checkpointing put around the model's own, dropped from parameter names.
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

# Per optimizer, per param group, per parameter: every name the parameter has in the model (several when tied).
ParameterNames = list[list[list[tuple[str, ...]]]]


def optimizer_parameter_names(module: Module, optimizers: Sequence[Optimizer]) -> ParameterNames:
    """The names in ``module`` of the parameters each param group of ``optimizers`` holds, before sharding.

    A parameter is found by identity, or by sharing its storage with a parameter of ``module`` (a precision plugin
    may have wrapped the weights the optimizer was built from in a tensor subclass, as torchao's float8 training does
    for FSDP2's float8 all-gather).

    Raises:
        ValueError: If an optimizer already holds state (it has stepped), or holds a tensor that is not a parameter of
            ``module``.

    """
    by_id: dict[int, list[str]] = {}
    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
        key = _storage_key(param)
        if key is not None:
            by_storage.setdefault(key, by_id[id(param)])
    names: ParameterNames = []
    for index, optimizer in enumerate(optimizers):
        if optimizer.state:
            raise ValueError(
                f"Optimizer {index} ({type(optimizer).__name__}) already holds state for {len(optimizer.state)}"
                " parameters, which sharding the model cannot carry over. Set the model and optimizer up before the"
                " optimizer's first step (and restore a saved state afterwards with `load_state` / `fabric.load`)."
            )
        groups = []
        for group_index, group in enumerate(optimizer.param_groups):
            group_names = []
            for position, param in enumerate(group["params"]):
                key = _storage_key(param)
                found = by_id.get(id(param)) or (by_storage.get(key) if key is not None else None)
                if found is None:
                    raise ValueError(
                        f"Optimizer {index} ({type(optimizer).__name__}) holds a tensor of shape {tuple(param.shape)}"
                        f" at param_groups[{group_index}]['params'][{position}] that is not a parameter of the"
                        f" {type(module).__name__} set up with it. Build the optimizer from that model's parameters,"
                        " or set up the model it belongs to."
                    )
                group_names.append(tuple(found))
            groups.append(group_names)
        names.append(groups)
    return names


def repoint_optimizers(sharded: Module, optimizers: Sequence[Optimizer], names: ParameterNames) -> None:
    """Replace the parameters in ``optimizers``' param groups by the parameters of the same names in ``sharded``.

    Args:
        sharded: The module after sharding.
        optimizers: The optimizers ``names`` was recorded from.
        names: What :func:`optimizer_parameter_names` returned before sharding.

    Raises:
        ValueError: If a recorded name has no parameter in ``sharded``, or a flat parameter (FSDP1 with
            ``use_orig_params=False``) holds parameters that one param group does not all hold. Nothing is changed
            then.

    """
    by_name, names_of = _sharded_parameters(sharded)
    replacements: list[list[list[Parameter]]] = []
    for index, groups in enumerate(names):
        per_group = []
        for group_index, group_names in enumerate(groups):
            held = {name for param_names in group_names for name in param_names}
            params: list[Parameter] = []
            for param_names in group_names:
                target = by_name.get(param_names[0])
                if target is None:
                    raise ValueError(
                        f"The parameter {param_names[0]!r} of optimizer {index} has no counterpart in the sharded"
                        f" model, whose parameters are {sorted(by_name)}."
                    )
                if any(target is p for p in params):
                    continue  # a flat parameter already standing in for an earlier parameter of this group
                left_out = names_of[id(target)] - held
                if left_out:
                    raise ValueError(
                        f"FSDP1 with use_orig_params=False flattens {sorted(names_of[id(target)])} into one"
                        f" parameter, but param group {group_index} of optimizer {index} holds only"
                        f" {sorted(names_of[id(target)] & held)} of them, so one optimizer setting would apply to"
                        f" {sorted(left_out)} as well. Set FullyShardedDataParallelPlugin(use_orig_params=True), or"
                        " put all of them in one param group."
                    )
                params.append(target)
            per_group.append(params)
        replacements.append(per_group)
    for optimizer, per_group in zip(optimizers, replacements, strict=True):
        for group, params in zip(optimizer.param_groups, per_group, strict=True):
            group["params"][:] = params


def check_sharded_parameters(optimizer: Optimizer, sharded: Iterable[Module]) -> None:
    """Refuse an optimizer that holds tensors none of the ``sharded`` modules has (it was built before sharding).

    Raises:
        ValueError: Naming the first such tensor and the two ways to set the optimizer up.

    """
    held = {id(p) for module in sharded for p in module.parameters()}
    for group_index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(group["params"]):
            if id(param) not in held:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} at"
                    f" param_groups[{group_index}]['params'][{position}] that is not a parameter of any model acc_fsdp"
                    " sharded: built before sharding, it would update tensors the model no longer uses. Set the model"
                    " and the optimizer up together (`fabric.setup(model, optimizer)`, `accelerator.prepare(model,"
                    " optimizer, ...)`), or build the optimizer from the sharded model's parameters."
                )


def _sharded_parameters(sharded: Module) -> tuple[dict[str, Parameter], dict[int, set[str]]]:
    """Each parameter of ``sharded`` by the model's own names, and the names each parameter stands for."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import _get_param_to_fqns

    if any(isinstance(m, FullyShardedDataParallel) for m in sharded.modules()):
        # FSDP1 knows which of the model's parameters each (flat) parameter holds.
        names_by_param = _get_param_to_fqns(sharded, dedup_shared_params=False)
        pairs = [(_model_name(name), param) for param, fqns in names_by_param.items() for name in fqns]
    else:
        pairs = [(_model_name(name), param) for name, param in sharded.named_parameters(remove_duplicate=False)]
    by_name: dict[str, Parameter] = {}
    names_of: dict[int, set[str]] = {}
    for name, param in pairs:
        by_name[name] = param
        names_of.setdefault(id(param), set()).add(name)
    return by_name, names_of


def _model_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _storage_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """Where ``tensor``'s data lives (unwrapping single-tensor subclasses), or ``None`` for tensors without data."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        if len(inner) != 1:
            return None
        tensor = getattr(tensor, inner[0])
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    return tensor.data_ptr(), tuple(tensor.shape)
