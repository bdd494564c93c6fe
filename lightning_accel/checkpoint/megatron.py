"""Checkpoints of ``acc_megatron_lm`` that do not depend on ``tp_degree``.

A tensor-parallel parameter (megatron marks it ``tensor_model_parallel`` with its ``partition_dim``) is stored whole:
saving gathers the shards over megatron's tensor-parallel group, loading takes this rank's slice, in the order
megatron's ``use_cpu_initialization`` splits a whole weight. Optimizer state of the parameter's shape (momentum,
Adam's moments) is treated the same way. So a checkpoint written at ``tp_degree=2`` holds what a ``tp_degree=1`` run
would hold, and resumes at either size. At ``pp_degree > 1`` each pipeline stage writes and reads its own file
(:func:`stage_checkpoint_path`), holding the stage's parameters under the stage's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module, Parameter
from torch.optim import Optimizer

__all__ = [
    "gather_model_state",
    "gather_optimizer_state",
    "global_layer_names",
    "split_model_state",
    "split_optimizer_state",
    "stage_checkpoint_path",
    "writes_stage_checkpoint",
]


def _tensor_parallel(param: Parameter) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _partition_dim(param: Parameter) -> int:
    return int(vars(param)["partition_dim"])  # megatron sets it on every tensor-parallel parameter


def _group_and_size() -> tuple[Any, int, int]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def _gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    group, size, _ = _group_and_size()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(whole: torch.Tensor, param: Parameter, what: str) -> torch.Tensor:
    _, size, rank = _group_and_size()
    dim = _partition_dim(param)
    if whole.shape == param.shape and size == 1:
        return whole
    expected = list(param.shape)
    expected[dim] *= size
    if list(whole.shape) != expected:
        raise ValueError(
            f"checkpoint entry {what} has shape {tuple(whole.shape)}, but tensor-parallel size {size} needs the "
            f"whole tensor {tuple(expected)}; was it written by acc_megatron_lm with another model?"
        )
    return whole.chunk(size, dim=dim)[rank].clone()


def gather_model_state(state_dict: Mapping[str, Any], module: Module) -> dict[str, Any]:
    """``state_dict`` of ``module``, each tensor-parallel parameter made whole (a collective: all ranks call it)."""
    params = dict(module.named_parameters())
    gathered = dict(state_dict)
    for name, value in state_dict.items():
        param = params.get(name)
        if param is not None and _tensor_parallel(param):
            gathered[name] = _gather(value, _partition_dim(param))
    return gathered


def split_model_state(state_dict: Mapping[str, Any], module: Module) -> dict[str, Any]:
    """``state_dict`` with every whole tensor-parallel parameter replaced by this rank's slice.

    Raises:
        ValueError: If a whole tensor does not have the shape this rank's shard implies.

    """
    params = dict(module.named_parameters())
    split = dict(state_dict)
    for name, value in state_dict.items():
        param = params.get(name)
        if param is not None and _tensor_parallel(param):
            split[name] = _split(value, param, repr(name))
    return split


def _indexed_params(optimizer: Optimizer) -> list[Parameter]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _map_state(optimizer_state: Mapping[str, Any], optimizer: Optimizer, convert: Any) -> dict[str, Any]:
    params = _indexed_params(optimizer)
    state = {}
    for index, entries in optimizer_state["state"].items():
        param = params[int(index)]
        state[index] = {
            key: convert(value, param, f"state[{index}][{key!r}]")
            if _tensor_parallel(param) and isinstance(value, torch.Tensor) and value.dim() == param.dim()
            else value
            for key, value in entries.items()
        }
    return {**optimizer_state, "state": state}


def gather_optimizer_state(optimizer_state: Mapping[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the state of tensor-parallel parameters made whole (a collective)."""
    return _map_state(optimizer_state, optimizer, lambda value, param, _: _gather(value, _partition_dim(param)))


def split_optimizer_state(optimizer_state: Mapping[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """A gathered optimizer state with this rank's slices, to pass to ``optimizer.load_state_dict``.

    Raises:
        ValueError: If a whole tensor does not have the shape this rank's shard implies.

    """
    return _map_state(optimizer_state, optimizer, _split)


def global_layer_names(module: Module) -> dict[str, str]:
    """Each ``state_dict`` key of a pipeline stage, mapped to the key the whole (``pp_degree=1``) model gives it.

    megatron numbers a stage's transformer layers from 0 (``decoder.layers.0`` on every stage) and records the
    global 1-based index as the layer's ``layer_number``; this renames the first to the second.
    """
    renamed: dict[str, str] = {}
    layers = {
        f"{name}.": f"{name.rsplit('.', 1)[0]}.{int(layer.layer_number) - 1}."
        for name, layer in module.named_modules()
        if name.rsplit(".", 1)[0].endswith("layers") and hasattr(layer, "layer_number")
    }
    for key in module.state_dict():
        prefix = next((local for local in layers if key.startswith(local)), None)
        renamed[key] = key if prefix is None else layers[prefix] + key[len(prefix) :]
    return renamed


def stage_checkpoint_path(path: str | Path) -> Path:
    """The file of this pipeline stage for a checkpoint named ``path`` (``path`` itself at ``pp_degree=1``).

    ``run.ckpt`` of a 2-stage pipeline is ``run_pp00.ckpt`` on the first stage and ``run_pp01.ckpt`` on the second,
    as megatron numbers its ``mp_rank_TT_PPP`` folders by pipeline rank.
    """
    from megatron.core import parallel_state

    path = Path(path)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return path
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return path.with_name(f"{path.stem}_pp{stage:02d}{path.suffix}")


def writes_stage_checkpoint() -> bool:
    """Whether this process writes its stage's file: tensor-parallel rank 0 of data-parallel rank 0 of the stage."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
