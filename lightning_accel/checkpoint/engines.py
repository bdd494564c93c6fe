"""Models and optimizers of sharded engines (FSDP, DeepSpeed) in ``save_state`` folders, with Accelerate 1.15's names.

These engines write the weights and optimizer state themselves; :mod:`lightning_accel.checkpointing` writes the rest
(schedulers, scaler, random states, registered objects) as for any run. Each Fabric strategy whose engine writes its
own files answers ``checkpoint_engine()`` (a member of the shim's strategy protocol) with its handler, so nothing
branches on the distributed type or the strategy class.

FSDP, by ``FullyShardedDataParallelPlugin.state_dict_type`` (model ``i``, optimizer ``i``):

- ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/``, ``torch.distributed.checkpoint``
  directories holding ``{"model": <state dict>}`` and ``{"optimizer": <state dict keyed by parameter name>}``, one
  shard file per process. A different number of processes can load them.
- ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_{i}.bin``) and ``optimizer.bin``
  (``optimizer_{i}.bin``), the gathered state dicts saved with ``torch.save`` by the main process.

Loading reads whichever of the two the folder holds. DeepSpeed: ``pytorch_model/`` (``pytorch_model_{i}/``), written by
the engine's ``save_checkpoint`` with that tag, with the ZeRO-partitioned optimizer state; DeepSpeed adds ``latest``
and ``zero_to_fp32.py`` next to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.checkpoint.fsdp_policy import state_dict_options
from lightning_accel.lightning_compat import fabric_forward_module, get_original_module
from lightning_accel.utils.constants import FSDP_MODEL_NAME, MODEL_NAME, OPTIMIZER_NAME

__all__ = [
    "DeepSpeedCheckpoint",
    "EngineCheckpoint",
    "FSDPCheckpoint",
    "engine_module",
]


def _indexed(stem: str, index: int, suffix: str = "") -> str:
    """Accelerate's name of the i-th object: ``stem{suffix}`` for the first, ``stem_{i}{suffix}`` after."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def engine_module(model: Module, prepared: Sequence[Module] = ()) -> Module:
    """The strategy-wrapped module of a prepared model (the FSDP module, the DeepSpeed engine).

    ``model`` may also be the user's own module that was prepared (found among ``prepared``).
    """
    if isinstance(model, _FabricModule):
        return fabric_forward_module(model)
    for candidate in prepared:
        if isinstance(candidate, _FabricModule) and get_original_module(candidate) is model:
            return fabric_forward_module(candidate)
    return model


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside an ``AcceleratedOptimizer`` and Fabric's wrapper."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner.optimizer if isinstance(inner, _FabricOptimizer) else inner


def _is_main_process() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _check_present(source: Path, wanted: Sequence[tuple[str, Sequence[Path]]]) -> None:
    """Raise if, for some object, none of its candidate paths exists (checked before any collective starts).

    Raises:
        ValueError: Naming the object and the paths looked for.

    """
    for what, candidates in wanted:
        if not any(path.exists() for path in candidates):
            names = " or ".join(path.name for path in candidates)
            raise ValueError(
                f"Checkpoint {source} has no {what}: expected {names}. Was it saved with another engine, or with"
                " fewer models or optimizers?"
            )


class EngineCheckpoint(ABC):
    """How one engine writes and reads its models and optimizers in a ``save_state`` folder.

    Every method is collective: all processes call it, with the same arguments.
    """

    @abstractmethod
    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Write the prepared ``models`` and ``optimizers`` into ``target`` (which exists)."""

    @abstractmethod
    def load(self, models: Sequence[Module], optimizers: Sequence[Any], source: Path, **kwargs: Any) -> None:
        """Restore the prepared ``models`` and ``optimizers`` from ``source``.

        Raises:
            ValueError: If ``source`` lacks a file or folder, before any process starts loading.

        """

    @abstractmethod
    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """The gathered weights of ``model`` on the main process (``{}`` on the others where they are sharded)."""


class FSDPCheckpoint(EngineCheckpoint):
    """FSDP1 and FSDP2 through ``torch.distributed.checkpoint``'s state-dict API, which speaks both.

    Args:
        state_dict_type: ``"SHARDED_STATE_DICT"`` or ``"FULL_STATE_DICT"``: what ``save`` writes. FSDP1's
            ``LOCAL_STATE_DICT`` (per-process flat shards) makes ``save`` and ``load`` raise ``ValueError``.
        after_load: Called with each module once its weights are loaded (the strategy's: e.g. refreshing fp8
            scales precomputed for the weights before the load).

    """

    def __init__(self, state_dict_type: str, after_load: Callable[[Module], None] | None = None) -> None:
        self.state_dict_type = state_dict_type
        self.full = state_dict_type == "FULL_STATE_DICT"
        self.after_load = after_load

    def _check(self, options: dict[str, Any]) -> None:
        _refuse_options("FSDP", options)
        if self.state_dict_type not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            raise ValueError(
                "save_state/load_state write FSDP checkpoints as SHARDED_STATE_DICT or FULL_STATE_DICT, got"
                f" state_dict_type={self.state_dict_type!r}. Set FullyShardedDataParallelPlugin(state_dict_type="
                "'SHARDED_STATE_DICT')."
            )

    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Write each model and optimizer as shards (a directory each) or as one gathered file."""
        self._check(kwargs)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        modules = [engine_module(m) for m in models]
        for i, module in enumerate(modules):
            state = get_model_state_dict(module, options=state_dict_options(module, self.full))
            self._write(state, "model", *_fsdp_paths(target, i, "model"))
        for i, optimizer in enumerate(optimizers):
            raw = _torch_optimizer(optimizer)
            module = _owner(modules, raw)
            optimizer_state = get_optimizer_state_dict(module, raw, options=state_dict_options(module, self.full))
            self._write(optimizer_state, "optimizer", *_fsdp_paths(target, i, "optimizer"))

    def _write(self, state: dict[str, Any], key: str, sharded: Path, full: Path) -> None:
        if not self.full:
            import torch.distributed.checkpoint as dcp

            dcp.save({key: state}, checkpoint_id=sharded)
        elif _is_main_process():
            torch.save(state, full)

    def load(self, models: Sequence[Module], optimizers: Sequence[Any], source: Path, **kwargs: Any) -> None:
        """Load shards or gathered files (whichever ``source`` holds) into the sharded models and optimizers."""
        self._check(kwargs)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        model_paths = [_fsdp_paths(source, i, "model") for i in range(len(models))]
        optimizer_paths = [_fsdp_paths(source, i, "optimizer") for i in range(len(optimizers))]
        _check_present(
            source,
            [(f"weights for model {i}", paths) for i, paths in enumerate(model_paths)]
            + [(f"state for optimizer {i}", paths) for i, paths in enumerate(optimizer_paths)],
        )
        modules = [engine_module(m) for m in models]
        for module, paths in zip(modules, model_paths, strict=True):
            state, options = _read(*paths, "model", partial(_model_shards, module))
            set_model_state_dict(module, state, options=options)
            if self.after_load is not None:
                self.after_load(module)
        for optimizer, paths in zip(optimizers, optimizer_paths, strict=True):
            raw = _torch_optimizer(optimizer)
            module = _owner(modules, raw)
            state, options = _read(*paths, "optimizer", partial(_optimizer_shards, module, raw))
            set_optimizer_state_dict(module, raw, state, options=options)

    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """The gathered weights on the main process's CPU, as Accelerate returns them under FSDP."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = engine_module(model, prepared)
        state = get_model_state_dict(module, options=state_dict_options(module, full=True))
        return dict(state) if _is_main_process() else {}


def _fsdp_paths(root: Path, index: int, kind: str) -> tuple[Path, Path]:
    """Accelerate's sharded directory and full file of model or optimizer ``index``."""
    if kind == "model":
        return root / f"{FSDP_MODEL_NAME}_{index}", root / _indexed(FSDP_MODEL_NAME, index, ".bin")
    return root / f"{OPTIMIZER_NAME}_{index}", root / _indexed(OPTIMIZER_NAME, index, ".bin")


def _read(sharded: Path, full: Path, key: str, layout: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """A state dict to load and the options to load it with, from a DCP directory or a ``torch.save`` file.

    A sharded directory is read into this process's shards (``layout()`` gives them); a full file is read by the
    main process only and broadcast while loading.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if sharded.is_dir():
        holder = {key: layout()}
        # Re-nesting FSDP1's ShardedTensors would also turn the optimizer's param_groups into one unknown key.
        dcp.load(holder, checkpoint_id=sharded, planner=dcp.DefaultLoadPlanner(flatten_sharded_tensors=False))
        return holder[key], StateDictOptions(full_state_dict=False)
    state = torch.load(full, map_location="cpu", weights_only=True) if _is_main_process() else {}
    return state, StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _model_shards(module: Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=state_dict_options(module, full=False))


def _optimizer_shards(module: Module, optimizer: Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(module, optimizer, options=state_dict_options(module, full=False)))


def _owner(modules: Sequence[Module], optimizer: Optimizer) -> Module:
    """The prepared module whose parameters ``optimizer`` updates.

    Raises:
        ValueError: If no prepared model holds the optimizer's parameters.

    """
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(
        f"A prepared {type(optimizer).__name__} updates parameters of no prepared model; under FSDP each optimizer"
        " must be created from one prepared model's parameters (prepare the model first)."
    )


def _refuse_options(engine: str, options: dict[str, Any]) -> None:
    if options:
        raise ValueError(
            f"save_state/load_state got {sorted(options)}, keyword arguments for DeepSpeed's save_checkpoint/"
            f"load_checkpoint, but this run uses {engine}; drop them."
        )


class DeepSpeedCheckpoint(EngineCheckpoint):
    """DeepSpeed's own checkpoint directories, one per engine (tags ``pytorch_model``, ``pytorch_model_1``, ...)."""

    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Call each engine's ``save_checkpoint(target, tag)``; ``kwargs`` go to it (``exclude_frozen_parameters``)."""
        for i, model in enumerate(models):
            engine: Any = engine_module(model)
            engine.save_checkpoint(str(target), tag=_indexed(MODEL_NAME, i), **kwargs)

    def load(self, models: Sequence[Module], optimizers: Sequence[Any], source: Path, **kwargs: Any) -> None:
        """Call each engine's ``load_checkpoint(source, tag)``; ``kwargs`` go to it (``load_optimizer_states``, ...).

        Raises:
            ValueError: If a tag folder is missing, or DeepSpeed loads nothing from it.

        """
        tags = [_indexed(MODEL_NAME, i) for i in range(len(models))]
        _check_present(source, [(f"DeepSpeed checkpoint for model {i}", [source / tag]) for i, tag in enumerate(tags)])
        for model, tag in zip(models, tags, strict=True):
            engine: Any = engine_module(model)
            loaded, _ = engine.load_checkpoint(str(source), tag=tag, **kwargs)
            if loaded is None:
                raise ValueError(f"DeepSpeed could not load {source / tag} (see its log above).")

    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """Under ZeRO-3, the weights gathered to the main process; under ZeRO 0-2 a CPU copy on every process.

        Raises:
            ValueError: Under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``, as Accelerate.

        """
        engine: Any = engine_module(model, prepared)
        if not engine.zero_optimization_partition_weights():
            return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        if not engine.zero_gather_16bit_weights_on_model_save():
            raise ValueError(
                "Under ZeRO-3 the weights are partitioned, and gathering them needs"
                " zero_optimization.stage3_gather_16bit_weights_on_model_save: set DeepSpeedPlugin("
                "zero3_save_16bit_model=True) (or the key in hf_ds_config). save_state writes the partitioned"
                " checkpoint without it, which zero_to_fp32.py (or consolidate_deepspeed_checkpoint) turns into"
                " full weights."
            )
        state = engine._zero3_consolidated_16bit_state_dict()
        return dict(state) if _is_main_process() else {}
