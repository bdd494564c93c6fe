"""Checkpoints of ``acc_megatron_lm`` that do not depend on ``tp_degree``.

A tensor-parallel parameter (megatron marks it ``tensor_model_parallel`` with its ``partition_dim``) is stored whole:
saving gathers the shards over megatron's tensor-parallel group, loading takes this rank's slice, in the order
megatron's ``use_cpu_initialization`` splits a whole weight. Optimizer state of the parameter's shape (momentum,
Adam's moments) is treated the same way. So a checkpoint written at ``tp_degree=2`` holds what a ``tp_degree=1`` run
would hold, and resumes at either size. At ``pp_degree > 1`` each pipeline stage writes and reads its own file
(:func:`stage_checkpoint_path`), holding the stage's parameters under the stage's names; the ``Accelerator``'s
``save_state`` folders hold one model and one optimizer file per stage (:class:`MegatronStageCheckpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_accel.checkpoint.engines import (
    EngineCheckpoint,
    check_present,
    engine_module,
    indexed_name,
    refuse_options,
    torch_optimizer,
)
from lightning_accel.utils.constants import MODEL_NAME, OPTIMIZER_NAME
from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file
from lightning_accel.utils.other import load, torch_save

__all__ = [
    "MegatronStageCheckpoint",
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


def _stage_module(model: Module) -> Module:
    inner = engine_module(model)
    return inner.module if isinstance(inner, DistributedDataParallel) else inner


class MegatronStageCheckpoint(EngineCheckpoint):
    """``save_state``'s models and optimizers under ``acc_megatron_lm``: whole tensors, one file of each per stage.

    Model ``i`` is ``pytorch_model.bin`` (``pytorch_model_{i}.bin``), at ``pp_degree > 1`` named for the stage by
    :func:`stage_checkpoint_path` (``pytorch_model_pp00.bin``, ``pytorch_model_pp01.bin``), optimizer ``i`` likewise
    (``optimizer.bin``, ``optimizer_pp00.bin``). Each holds the stage's whole tensor-parallel tensors, written by the
    stage's first tensor- and data-parallel rank; loading reads the stage's own files and takes this rank's slices,
    so a folder written at ``tp_degree=2`` holds what ``tp_degree=1`` writes.
    """

    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Gather each stage's model and optimizer state (collectives) and write the stage's files."""
        refuse_options("acc_megatron_lm", kwargs)
        states = [(self._model_file(target, i), _gathered_model(m)) for i, m in enumerate(models)]
        states += [(self._optimizer_file(target, i), _gathered_optimizer(o)) for i, o in enumerate(optimizers)]
        if writes_stage_checkpoint():
            for path, state in states:
                torch_save(state, path)

    def load(
        self,
        models: Sequence[Module],
        optimizers: Sequence[Any],
        source: Path,
        *,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> None:
        """Load this stage's files into the prepared ``models`` and ``optimizers`` (this rank's slices).

        Raises:
            ValueError: If a file of this stage is missing (before anything is loaded), or cannot be read.

        """
        refuse_options("acc_megatron_lm", kwargs)
        model_files = [self._model_file(source, i) for i in range(len(models))]
        optimizer_files = [self._optimizer_file(source, i) for i in range(len(optimizers))]
        wanted = [(f"pipeline-stage file of model {i}", [path]) for i, path in enumerate(model_files)]
        wanted += [(f"pipeline-stage file of optimizer {i}", [path]) for i, path in enumerate(optimizer_files)]
        check_present(source, wanted)

        def read(path: Path) -> Any:
            return load(path, map_location="cpu", weights_only=weights_only)

        for model, path in zip(models, model_files, strict=True):
            stage = _stage_module(model)
            stage.load_state_dict(split_model_state(read_checkpoint_file(path, read), stage))
        for optimizer, path in zip(optimizers, optimizer_files, strict=True):
            inner = torch_optimizer(optimizer)
            inner.load_state_dict(split_optimizer_state(read_checkpoint_file(path, read), inner))

    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """The model's whole weights, tensor-parallel shards gathered (a collective), on every process.

        Raises:
            ValueError: At ``pp_degree > 1``, where each pipeline stage holds part of the model.

        """
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return _gathered_model(engine_module(model, prepared))
        raise ValueError(
            "At MegatronLMPlugin(pp_degree > 1) each pipeline stage holds part of the model, so there is no whole "
            "state dict on one process: use accelerator.save_state(folder), which writes one model file per stage "
            "(pytorch_model_pp00.bin, ...), or pp_degree=1 to save the whole model."
        )

    @staticmethod
    def _model_file(folder: Path, index: int) -> Path:
        return stage_checkpoint_path(folder / indexed_name(MODEL_NAME, index, ".bin"))

    @staticmethod
    def _optimizer_file(folder: Path, index: int) -> Path:
        return stage_checkpoint_path(folder / indexed_name(OPTIMIZER_NAME, index, ".bin"))


def _gathered_model(model: Module) -> dict[str, Any]:
    stage = _stage_module(model)
    return gather_model_state(stage.state_dict(), stage)


def _gathered_optimizer(optimizer: Any) -> dict[str, Any]:
    inner = torch_optimizer(optimizer)
    return gather_optimizer_state(inner.state_dict(), inner)
