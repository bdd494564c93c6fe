"""Models and optimizers of sharded engines (FSDP, DeepSpeed) in ``save_state`` folders, with Accelerate 1.15's names.

These engines write the weights and optimizer state themselves; :mod:`lightning_accel.checkpointing` writes the rest
(schedulers, scaler, random states, registered objects) as for any run. Each Fabric strategy whose engine writes its
own files answers ``checkpoint_engine()`` (a member of the shim's strategy protocol) with its handler, so nothing
branches on the distributed type or the strategy class.

FSDP's handler and layout are in :mod:`lightning_accel.checkpoint.fsdp_layout`. DeepSpeed: ``pytorch_model/``
(``pytorch_model_{i}/``), written by the engine's ``save_checkpoint`` with that tag, with the ZeRO-partitioned
optimizer state; DeepSpeed adds ``latest`` and ``zero_to_fp32.py`` next to it.

A handler whose ``writes_in_background`` is true can also :meth:`~EngineCheckpoint.stage` a save: its collectives
(gathers, DeepSpeed's barriers) run in the call and leave the state in host memory, and what it returns writes the
same files later, from ``save_state(async_save=True)``'s thread (:mod:`lightning_accel.checkpoint.background`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, cast

from lightning.fabric.wrappers import _FabricModule
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.checkpoint.background import host_copy
from lightning_accel.lightning_compat import fabric_forward_module, get_original_module
from lightning_accel.utils.constants import MODEL_NAME
from lightning_accel.utils.modeling.checkpoint import check_deepspeed_files
from lightning_accel.utils.operations import _is_main_process

__all__ = [
    "DeepSpeedCheckpoint",
    "EngineCheckpoint",
    "check_present",
    "engine_module",
    "indexed_name",
    "refuse_options",
    "torch_optimizer",
]


def indexed_name(stem: str, index: int, suffix: str = "") -> str:
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


def torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside the shim's and Fabric's wrappers (each keeps it as ``.optimizer``), or itself."""
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return cast(Optimizer, optimizer)


def check_present(source: Path, wanted: Sequence[tuple[str, Sequence[Path]]]) -> None:
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

    writes_in_background: ClassVar[bool] = False
    """Whether :meth:`stage` splits a save into the call's collectives and a later write (``async_save``)."""

    @abstractmethod
    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Write the prepared ``models`` and ``optimizers`` into ``target`` (which exists)."""

    def stage(
        self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any
    ) -> Callable[[], None]:
        """Take what :meth:`save` writes into host memory now; return the writing, for a background thread.

        The returned call writes the files :meth:`save` writes, as they were at this call. It runs no collective on
        the default process group (only on :func:`~lightning_accel.checkpoint.background.background_group`), so
        training may go on meanwhile.

        Raises:
            NotImplementedError: Where ``writes_in_background`` is false (``save_state`` refuses before).

        """
        raise NotImplementedError(f"{type(self).__name__} writes its checkpoints in the call only")

    @abstractmethod
    def load(
        self,
        models: Sequence[Module],
        optimizers: Sequence[Any],
        source: Path,
        *,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> None:
        """Restore the prepared ``models`` and ``optimizers`` from ``source``.

        Every file is read weights-only unless ``weights_only=False`` (a trusted folder; it warns naming each file).

        Raises:
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
            ValueError: If ``source`` lacks a file or folder, before any process starts loading.

        """

    @abstractmethod
    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """The gathered weights of ``model`` on the main process (``{}`` on the others where they are sharded)."""


def refuse_options(engine: str, options: dict[str, Any]) -> None:
    """Refuse ``save_state``/``load_state`` keyword arguments (DeepSpeed's) under another ``engine``."""
    if options:
        raise ValueError(
            f"save_state/load_state got {sorted(options)}, keyword arguments for DeepSpeed's save_checkpoint/"
            f"load_checkpoint, but this run uses {engine}; drop them."
        )


class DeepSpeedCheckpoint(EngineCheckpoint):
    """DeepSpeed's own checkpoint directories, one per engine (tags ``pytorch_model``, ``pytorch_model_1``, ...).

    In the background (:meth:`stage`), ``save_checkpoint`` runs in the call with its checkpoint engine's writes
    deferred: each state it hands to ``checkpoint_engine.save`` is copied into host memory, and the thread saves the
    copies through that engine (``torch.save``, as in the call) and commits. DeepSpeed's small files (``latest``,
    ``zero_to_fp32.py``) are written in the call.
    """

    writes_in_background: ClassVar[bool] = True

    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Call each engine's ``save_checkpoint(target, tag)``; ``kwargs`` go to it (``exclude_frozen_parameters``)."""
        for i, model in enumerate(models):
            engine: Any = engine_module(model)
            engine.save_checkpoint(str(target), tag=indexed_name(MODEL_NAME, i), **kwargs)

    def stage(
        self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any
    ) -> Callable[[], None]:
        """Run each engine's ``save_checkpoint`` with its file writes deferred; return them.

        Raises:
            ValueError: For a checkpoint engine other than DeepSpeed's ``torch.save`` one (the decoupled, fast and
                Nebula engines write in their own ways), before any engine saves.

        """
        engines: list[Any] = [engine_module(model) for model in models]
        for engine in engines:
            _refuse_own_writer(engine.checkpoint_engine)
        writes: list[Callable[[], object]] = []
        for i, engine in enumerate(engines):
            with _deferred_writes(engine, writes):
                engine.save_checkpoint(str(target), tag=indexed_name(MODEL_NAME, i), **kwargs)
        return lambda: _run_all(writes)

    def load(
        self,
        models: Sequence[Module],
        optimizers: Sequence[Any],
        source: Path,
        *,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> None:
        """Call each engine's ``load_checkpoint(source, tag)``; ``kwargs`` go to it (``load_optimizer_states``, ...).

        DeepSpeed unpickles its files in full, so each tag's files are first read weights-only
        (:func:`~lightning_accel.utils.modeling.checkpoint.check_deepspeed_files`) unless ``weights_only=False``.

        Raises:
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.
            ValueError: If a tag folder is missing, or DeepSpeed loads nothing from it.

        """
        tags = [indexed_name(MODEL_NAME, i) for i in range(len(models))]
        check_present(source, [(f"DeepSpeed checkpoint for model {i}", [source / tag]) for i, tag in enumerate(tags)])
        for tag in tags:
            check_deepspeed_files(source / tag, weights_only)
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


def _run_all(writes: Sequence[Callable[[], object]]) -> None:
    for write in writes:
        write()


def _refuse_own_writer(checkpoint_engine: Any) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(
            f"save_state(async_save=True) defers the writes of DeepSpeed's TorchCheckpointEngine, but this engine"
            f" writes with {type(checkpoint_engine).__name__} (its own way of writing): save with async_save=False,"
            " or drop the checkpoint writer from the DeepSpeed config."
        )


class _DeferredWrites:
    """A DeepSpeed checkpoint engine that copies each state it is to save into host memory and saves it later."""

    def __init__(self, engine: Any, writes: list[Callable[[], object]]) -> None:
        self._engine, self._writes = engine, writes

    def save(self, state_dict: Any, path: str) -> None:
        self._writes.append(partial(self._engine.save, host_copy(state_dict), path))

    def commit(self, info: Any) -> bool:
        self._writes.append(partial(self._engine.commit, info))
        return True

    def __getattr__(self, name: str) -> Any:  # create, makedirs, is_decoupled, ...: the engine's own
        return getattr(self._engine, name)


@contextlib.contextmanager
def _deferred_writes(engine: Any, writes: list[Callable[[], object]]) -> Iterator[None]:
    """Within, ``engine.save_checkpoint`` appends its file writes to ``writes`` instead of writing."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = _DeferredWrites(own, writes)
    try:
        yield
    finally:
        engine.checkpoint_engine = own
