"""The ``Accelerator``'s checkpoints: registered objects and hooks, state dicts, ``save_model``, the state folders.

``save_state``/``load_state`` gather the prepared and registered objects and pass them to the file functions of
:mod:`lightning_accel.checkpoint.state_files` (the ones Accelerate's ``save_accelerator_state`` uses too), publish the
folder with :mod:`lightning_accel.checkpoint.folders`, and let sharded engines (FSDP, DeepSpeed) write their models and
optimizers through :mod:`lightning_accel.checkpoint.engines` (the handler the strategy's ``checkpoint_engine()``
returns).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from lightning.fabric import Fabric
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from lightning_accel._accelerator.module import AcceleratedModule
from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel.checkpoint import state_files
from lightning_accel.checkpoint.background import BackgroundSave, HostBuffers, host_copy
from lightning_accel.checkpoint.engines import EngineCheckpoint
from lightning_accel.checkpoint.folders import (
    SaveTarget,
    abandon_on_error,
    numbered_checkpoints,
    on_disk_managers,
    publish,
    remove_stale,
    rotate,
    stage,
)
from lightning_accel.checkpoint.loader_states import loader_positions, save_loader_states
from lightning_accel.checkpoint.manifest import ChecksumName, Checksums, verify_manifest, write_manifest
from lightning_accel.checkpoint.node_copies import complete_on_each_node
from lightning_accel.checkpointing import accelerate_sampler, save_custom_state, shard_state_dict
from lightning_accel.checkpointing import save_model as write_model_files
from lightning_accel.config import ProjectConfiguration
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.state.shared_errors import raise_on_every_process, require_every_process, run_where
from lightning_accel.utils.constants import OPTIMIZER_NAME, SCHEDULER_NAME
from lightning_accel.utils.modeling.offloaded import get_state_dict_offloaded_model, has_offloaded_params
from lightning_accel.utils.other import extract_model_from_parallel, observing_writes, save

if TYPE_CHECKING:
    import torch

    from lightning_accel.state import AcceleratorState
    from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["Checkpoints", "LossScaling", "Restored", "check_save_model_arguments"]


class LossScaling(Protocol):
    """What the checkpoints ask of the precision members: the fp16 loss scaler, saved as ``scaler.pt``."""

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler, ``None`` without one."""
        ...


class Restored(NamedTuple):
    """What ``load_state`` restored that the ``Accelerator`` keeps: the folder read and the micro-step counter."""

    folder: str
    step: int | None


def check_save_model_arguments(
    model: object, save_directory: object, max_shard_size: object, safe_serialization: object
) -> None:
    """Refuse bad ``save_model`` arguments (call it on every process, before any collective).

    Raises:
        TypeError: For a ``model`` that is not a module, a ``save_directory`` that is not a path, or a non-boolean
            ``safe_serialization``.
        ValueError: For a ``save_directory`` that is a file, or a ``max_shard_size`` that is not a positive size.

    """
    if not isinstance(model, Module):
        raise TypeError(f"save_model(model=...) takes a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(save_directory, (str, os.PathLike)):
        raise TypeError(f"save_model(save_directory={save_directory!r}) takes a path (str or os.PathLike).")
    if Path(save_directory).is_file():
        raise ValueError(f"save_model needs a directory, but {os.fspath(save_directory)} is a file.")
    if not isinstance(safe_serialization, bool):
        raise TypeError(f"save_model(safe_serialization={safe_serialization!r}) takes True or False.")
    if not _is_positive_size(max_shard_size):
        raise ValueError(
            f"save_model(max_shard_size={max_shard_size!r}) must be a positive number of bytes or a size such as"
            " '10GB', '500MB' or '1KB'."
        )


def _is_positive_size(size: object) -> bool:
    """Whether ``size`` is what :func:`~lightning_accel.checkpointing.shard_state_dict` reads, and above zero."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        return False
    try:
        shard_state_dict({}, "{suffix}", size)  # parses the size exactly as the writer will
    except ValueError:
        return False
    return size > 0 if isinstance(size, int) else float(size.strip()[:-2]) > 0


@dataclass
class _Taken:
    """A ``state_dict()`` taken at ``save_state``'s call, behind the ``state_dict()`` the file writers call."""

    state: Any
    __qualname__: str  # the original's class, for the writers' log lines

    @classmethod
    def of(cls, obj: Any) -> _Taken:
        return cls(obj.state_dict(), type(obj).__qualname__)

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state_dict: Any, /) -> None:
        raise TypeError("a state taken for a checkpoint is written, never loaded into")


@dataclass
class _LoaderState:
    """A prepared loader as the writers see it at ``save_state``'s call: Accelerate's sampler, its stateful state."""

    sampler: Any
    use_stateful_dataloader: bool
    state: Any

    @classmethod
    def of(cls, loader: Any) -> _LoaderState:
        stateful = bool(getattr(loader, "use_stateful_dataloader", False))
        return cls(accelerate_sampler(loader), stateful, loader.state_dict() if stateful else None)

    def state_dict(self) -> Any:
        return self.state

    @staticmethod
    def accelerate_sampler(taken: _LoaderState) -> Any:
        return taken.sampler


@dataclass
class _Staged:
    """What one process writes into a save's folder, taken at the call (see ``Checkpoints._stage``)."""

    shared: bool  # whether this process writes the shared files (weights, optimizers, ...)
    weights: list[dict[str, Any]]
    optimizers: list[_Taken]
    schedulers: list[_Taken]
    loaders: list[_LoaderState]
    scaler: _Taken | None
    custom: list[_Taken]
    process_index: int
    record: dict[str, Any]  # random_states_<i>.pkl


class Checkpoints:
    """Accelerate's checkpoint calls for the ``Accelerator``: registered objects and hooks, state dicts, the folders.

    It reads the prepared objects and the process state it is given, and writes through
    :mod:`lightning_accel.checkpoint`; it never reads the ``Accelerator``.

    Args:
        fabric: The ``Accelerator``'s Fabric (its strategy's module state dict, its broadcast).
        strategy: The Fabric's strategy, seen through :class:`~lightning_accel.strategies.protocol.ShimStrategy`.
        state: The shared process state (who is the main process, the barrier).
        prepared: What ``prepare`` returned and ``register_for_checkpointing`` added.
        project: Folder naming, rotation and ``save_on_each_node``; its ``iteration`` counts the saves.
        precision: Answers the fp16 loss scaler saved beside the optimizers.
        timeout: How long a collective call waits for a process that does not arrive (``None``: the process group's).

    """

    def __init__(
        self,
        *,
        fabric: Fabric,
        strategy: ShimStrategy,
        state: AcceleratorState,
        prepared: PreparedObjects,
        project: ProjectConfiguration,
        precision: LossScaling,
        timeout: timedelta | None,
    ) -> None:
        self._fabric = fabric
        self._strategy = strategy
        self._state = state
        self._prepared = prepared
        self._project = project
        self._precision = precision
        self._timeout = timeout
        # OrderedDict: RemovableHandle keeps a weak reference to it, which a plain dict refuses.
        self._save_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._pending: BackgroundSave | None = None
        self._host_buffers = HostBuffers()  # an asynchronous save's host copy, kept for the next one
        self._checksums = Checksums()  # the last save's: its writers record into it, its publication reads it

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Add ``objects`` to what ``save_state`` saves (see ``Accelerator.register_for_checkpointing``)."""
        invalid = [
            f"Item at index {i} ({type(o).__name__})"
            for i, o in enumerate(objects)
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if invalid:
            raise ValueError(
                f"Objects to checkpoint need `state_dict` and `load_state_dict` methods; these lack them: {invalid}."
            )
        self._prepared.custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Add a hook ``save_state`` calls before writing the weights (see the ``Accelerator``'s)."""
        handle = RemovableHandle(self._save_pre_hooks)
        self._save_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Add a hook ``load_state`` calls before loading the weights (see the ``Accelerator``'s)."""
        handle = RemovableHandle(self._load_pre_hooks)
        self._load_pre_hooks[handle.id] = hook
        return handle

    def get_state_dict(self, model: Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict (see ``Accelerator.get_state_dict``)."""
        if not unwrap:
            return dict(self._fabric.strategy.get_module_state_dict(fabric_forward_module(model)))
        engine = self._strategy.checkpoint_engine()
        if engine is not None:
            require_every_process("get_state_dict", self._why_collective(), self._timeout)
            return engine.full_state_dict(model, self._prepared.models)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        module = extract_model_from_parallel(model)
        if any(has_offloaded_params(m) for m in module.modules()):  # big-model hooks keep weights on meta/disk
            return get_state_dict_offloaded_model(module)
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        if sharded:
            why = "its weights are sharded DTensors, gathered over every process"
            require_every_process("get_state_dict", why, self._timeout)
        options = StateDictOptions(full_state_dict=True, cpu_offload=sharded)  # torch gathers for any parallelism
        return dict(get_model_state_dict(module, options=options))

    def save_model(
        self,
        model: Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's weight files (see ``Accelerator.save_model``)."""
        check_save_model_arguments(model, save_directory, max_shard_size, safe_serialization)
        sharded = self._strategy.checkpoint_engine() is not None
        state = self.get_state_dict(model)  # collective under sharded engines only

        def write() -> None:
            write_model_files(
                state, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
            )

        if sharded:
            run_where(self._state.is_main_process, write, "save_model")
        elif self._state.is_main_process:  # replicated weights: callable from the main process alone, as Accelerate's
            write()

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` once (per node with ``save_on_each_node``); see :func:`lightning_accel.utils.other.save`."""
        save(obj, f, self._project.save_on_each_node, safe_serialization=safe_serialization)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None,
        safe_serialization: bool,
        *,
        step: int,
        async_save: bool,
        checksum: ChecksumName | None,
        engine_kwargs: dict[str, Any],
    ) -> str:
        """Write the checkpoint folder (see :meth:`lightning_accel.Accelerator.save_state`); returns its path.

        ``step`` is the ``Accelerator``'s micro-step counter, saved with this process's random states; ``checksum``
        is the manifest's algorithm (see :mod:`lightning_accel.checkpoint.manifest`). With
        ``async_save`` the state is copied into host memory and written by a thread (see
        :mod:`lightning_accel.checkpoint.background`; a sharded engine stages its own, see
        :meth:`EngineCheckpoint.stage`); a save still pending is finished first.
        """
        self.wait_for_checkpoint()
        self._checksums = Checksums(checksum)
        engine = self._engine(engine_kwargs)
        if async_save and engine is not None and not engine.writes_in_background:
            raise ValueError(
                f"save_state(async_save=True) is not available under {self._state.distributed_type}, whose engine"
                " writes its own sharded files in the call: save with async_save=False."
            )
        if engine is None and not self._project.automatic_checkpoint_naming:
            return self._save_alone(output_dir, safe_serialization, step, async_save)
        why = self._why_collective() if engine is not None else "automatic naming counts the saves of every process"
        require_every_process("save_state", why, self._timeout)
        return self._save_together(engine, output_dir, safe_serialization, step, async_save, engine_kwargs)

    def wait_for_checkpoint(self) -> None:
        """Finish the pending background save, if any: publish it (collective where it was) or raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def end(self) -> None:
        """Finish the pending background save and give back the host memory kept for the next one."""
        self.wait_for_checkpoint()
        self._host_buffers.release()

    def _save_alone(
        self, output_dir: str | os.PathLike[str] | None, safe_serialization: bool, step: int, background: bool
    ) -> str:
        """``save_state`` without a collective: the publisher writes and publishes, the others stage their files."""
        config = self._project
        publisher = self._state.is_local_main_process if config.save_on_each_node else self._state.is_main_process
        final = state_files.choose_target(config, output_dir)
        target = SaveTarget(final, publisher=0 if self._state.is_main_process else self._state.process_index)
        if publisher:
            remove_stale(target)
            target.temporary.mkdir(parents=True, exist_ok=True)
        staged = self._stage(target.temporary, None, step, shared=publisher, background=background)
        if publisher:

            def write() -> None:
                with abandon_on_error(target.temporary):
                    self._write_staged(target.temporary, staged, safe_serialization)
                    write_manifest(target.temporary, self._checksums)

            self._run(write, lambda: publish(target), background=background, together=False, what=str(final))
        else:

            def write() -> None:
                stage(
                    target,
                    self._state.process_index,
                    own=lambda folder: self._write_staged(folder, staged, safe_serialization),
                    defaults=lambda folder: save_loader_states(staged.loaders, folder),
                )

            self._run(write, lambda: None, background=background, together=False, what=str(final))
        config.iteration += 1
        return str(final)

    def _save_together(
        self,
        engine: EngineCheckpoint | None,
        output_dir: str | os.PathLike[str] | None,
        safe_serialization: bool,
        step: int,
        background: bool,
        engine_kwargs: dict[str, Any],
    ) -> str:
        """``save_state`` on every process: the main process chooses the folder, every one writes, it is published."""
        config = self._project
        chosen: list[Any] = [None, None]
        if self._state.is_main_process:
            try:
                chosen[0] = state_files.choose_target(config, output_dir)
            except ValueError as err:
                chosen[1] = err
        chosen = cast("list[Any]", self._fabric.broadcast(chosen, src=0))
        raise_on_every_process(chosen[1], "save_state")  # the broadcast already reached every process
        target = SaveTarget(Path(chosen[0]))
        self._on_disk_managers(lambda: remove_stale(target), "save_state (clearing an interrupted save)")
        target.temporary.mkdir(parents=True, exist_ok=True)
        write_engine = self._engine_files(engine, target.temporary, background, engine_kwargs)
        writer = self._state.is_local_main_process if config.save_on_each_node else self._state.is_main_process
        staged = self._stage(target.temporary, engine, step, shared=writer, background=background)

        def write() -> None:
            with abandon_on_error(target.temporary):
                write_engine()
                self._write_staged(target.temporary, staged, safe_serialization)

        self._run(
            write, lambda: self._publish_together(target), background=background, together=True, what=str(target.final)
        )
        config.iteration += 1  # a background save counts at the call: the next one gets the next name
        self._write_own_folder(output_dir, target.final, step)
        return str(target.final)

    def _engine_files(
        self, engine: EngineCheckpoint | None, folder: Path, background: bool, engine_kwargs: dict[str, Any]
    ) -> Callable[[], None]:
        """Save the engine's models and optimizers into ``folder`` now, or stage them: what is left to write.

        Collective. A synchronous save waits for every process here; a staged one leaves the engine's writing to the
        background thread (see :meth:`EngineCheckpoint.stage`).
        """
        if engine is None:
            return lambda: None
        models, optimizers = self._prepared.models, self._prepared.optimizers
        with abandon_on_error(folder):
            if background:
                return engine.stage(models, optimizers, folder, **engine_kwargs)
            engine.save(models, optimizers, folder, **engine_kwargs)
        self._state.wait_for_everyone()
        return lambda: None

    def _publish_together(self, target: SaveTarget) -> None:
        """Every process: give a folder that every process wrote its name (each node's), then rotate."""
        config = self._project
        if config.save_on_each_node:  # node-local disks: each node gets the files (shards, metadata) it lacks
            complete_on_each_node(target.temporary, node_manager=self._state.is_local_main_process, what="save_state")
        checksums = self._checksums
        publishing = "save_state (publishing the checkpoint)"
        self._on_disk_managers(lambda: _publish_with_manifest(target, checksums), publishing)
        if config.automatic_checkpoint_naming:
            self._on_disk_managers(lambda: rotate(target.final.parent, config.total_limit), "save_state (rotation)")

    def _run(
        self, write: Callable[[], None], publish: Callable[[], None], *, background: bool, together: bool, what: str
    ) -> None:
        """Write then publish now, or leave both to a :class:`BackgroundSave` (publishing in it unless ``together``).

        A save made ``together`` waits for every process before it is published.
        """
        if background:
            self._pending = BackgroundSave(write, publish, together=together, what=what)
            return
        write()
        if together:
            self._state.wait_for_everyone()
        publish()

    def _stage(
        self, folder: Path, engine: EngineCheckpoint | None, step: int, *, shared: bool, background: bool
    ) -> _Staged:
        """What this process writes, taken now: the shared files' states where ``shared``, its random states.

        The save pre-hooks run here (they get the folder, and may pop weights to save them their own way). With
        ``background`` every state is copied into host memory, so that training may go on changing the originals.
        """
        weights: list[dict[str, Any]] = []
        if shared:
            # The users' modules, without the strategy's wrapper; an engine saved its own (hooks get none).
            weights = [model.state_dict() for model in self._prepared.models] if engine is None else []
            user_models = [model.module for model in self._prepared.models]  # as Accelerate's hooks see them
            for hook in list(self._save_pre_hooks.values()):
                hook(user_models, weights, str(folder))
        staged = _Staged(
            shared=shared,
            weights=weights,
            optimizers=[_Taken.of(o) for o in self._prepared.optimizers] if shared and engine is None else [],
            schedulers=[_Taken.of(s) for s in self._prepared.schedulers] if shared else [],
            loaders=[_LoaderState.of(loader) for loader in self._prepared.dataloaders],
            scaler=_Taken.of(self._precision.scaler) if shared and self._precision.scaler is not None else None,
            custom=[_Taken.of(o) for o in self._prepared.custom_objects] if shared else [],
            process_index=self._state.process_index,
            record=state_files.process_record(step, loader_positions(self._prepared.dataloaders)),
        )
        return host_copy(staged, self._host_buffers) if background else staged

    def _write_staged(self, folder: Path, staged: _Staged, safe_serialization: bool) -> None:
        """Write what :meth:`_stage` took: the shared files (where this process writes them), its random states."""
        with observing_writes(self._checksums):
            self._write_staged_files(folder, staged, safe_serialization)

    def _write_staged_files(self, folder: Path, staged: _Staged, safe_serialization: bool) -> None:
        if staged.shared:
            state_files.write_shared_files(
                folder,
                staged.weights,
                staged.optimizers,
                staged.schedulers,
                staged.loaders,
                staged.scaler,
                safe_serialization,
                _LoaderState.accelerate_sampler,
            )
            for i, obj in enumerate(staged.custom):
                save_custom_state(obj, folder, i, self._project.save_on_each_node)
        state_files.write_process_record(folder, staged.process_index, staged.record)

    def _write_process_states(self, folder: Path, step: int) -> None:
        positions = loader_positions(self._prepared.dataloaders)
        state_files.write_process_states(folder, self._state.process_index, step, positions)

    def _write_own_folder(self, requested: str | os.PathLike[str] | None, written: Path, step: int) -> None:
        """Where this process named another folder than ``written`` (the main process's), put its own files there.

        Its own files are its random states and the states of its stateful loaders (what Accelerate has every process
        write); the shared files stay in ``written`` only, as Accelerate writes them on the main process only.
        """
        if requested is None or Path(requested).resolve() == written.resolve():
            return
        folder = Path(requested)
        folder.mkdir(parents=True, exist_ok=True)
        self._write_process_states(folder, step)
        save_loader_states(self._prepared.dataloaders, folder)

    def _engine(self, engine_kwargs: dict[str, Any]) -> EngineCheckpoint | None:
        """The handler of an engine that writes its own model files, checking the arguments meant for it.

        Raises:
            ValueError: On every process, before any barrier: for ``engine_kwargs`` without such an engine, or for
                sharded (DTensor) weights that no handler writes.

        """
        engine = self._strategy.checkpoint_engine()
        if engine is None:
            if engine_kwargs:
                raise ValueError(
                    f"save_state/load_state got {sorted(engine_kwargs)}, keyword arguments for DeepSpeed's"
                    f" save_checkpoint/load_checkpoint, but this run is {self._state.distributed_type}; drop them."
                )
            _refuse_sharded(list(self._prepared.models))
        return engine

    def _why_collective(self) -> str:
        return f"under {self._state.distributed_type} each process holds a shard of the state"

    def _on_disk_managers(self, action: Callable[[], None], what: str) -> None:
        other_node_manager = (
            self._project.save_on_each_node and self._state.is_local_main_process and not self._state.is_main_process
        )
        on_disk_managers(action, is_main=self._state.is_main_process, other_node_manager=other_node_manager, what=what)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None,
        load_kwargs: dict[str, Any] | None,
        *,
        missing_ok: bool,
        resume_position: bool,
        weights_only: bool | None,
        engine_kwargs: dict[str, Any],
    ) -> Restored | None:
        """Load a checkpoint folder (see :meth:`lightning_accel.Accelerator.load_state`).

        Returns:
            The folder and the micro-step counter it holds for this process; ``None`` with ``missing_ok`` and
            nothing to load.

        """
        self.wait_for_checkpoint()
        if missing_ok and not self._has_checkpoint(input_dir):
            return None
        extra = dict(load_kwargs or {})
        safe = _weights_only(weights_only, extra)
        engine = self._engine(engine_kwargs)
        if engine is not None:
            require_every_process("load_state", self._why_collective(), self._timeout)
        config = self._project
        source = state_files.latest_source(config, input_dir)
        verify_manifest(source)
        models = list(self._prepared.models) if engine is None else []  # an engine loads its models itself
        user_models = [model.module for model in models]
        for hook in list(self._load_pre_hooks.values()):
            hook(user_models, str(source))  # a hook may pop models to load them its own way
        kept = {id(module) for module in user_models}
        scaler = self._precision.scaler
        if scaler is not None and (source / "scaler.pt").is_file():
            state_files.load_scaler(scaler, source)  # before optimizers, which FSDP2 may step
        if engine is not None:
            engine.load(self._prepared.models, self._prepared.optimizers, source, weights_only=safe, **engine_kwargs)
        for i, model in enumerate(m for m in models if id(m.module) in kept):
            state_files.load_model_weights(model, source, i)
        state_files.load_state_dicts(
            self._prepared.optimizers if engine is None else [], source, OPTIMIZER_NAME, **extra
        )
        state_files.load_state_dicts(self._prepared.schedulers, source, SCHEDULER_NAME, **extra)
        state_files.load_custom_objects(self._prepared.custom_objects, source, weights_only=safe)
        step = self._load_process_states(source, extra, resume_position, safe)
        config.iteration = state_files.next_iteration(config, source)
        return Restored(str(source), step)

    def _load_process_states(
        self, source: Path, load_kwargs: dict[str, Any], positions: bool, weights_only: bool
    ) -> int | None:
        """Restore this process's random states, its loaders' epochs (and positions) and stateful states, the step."""
        state_files.load_samplers(self._prepared.dataloaders, source, accelerate_sampler, weights_only=weights_only)
        hint = " (was the run saved by fewer processes, or did only some of its processes call save_state?)"
        states = state_files.load_process_states(
            source, self._state.process_index, self._prepared.dataloaders, hint, positions=positions, **load_kwargs
        )
        return None if states is None else int(states.get("step", 0))

    def _has_checkpoint(self, input_dir: str | os.PathLike[str] | None) -> bool:
        config = self._project
        if input_dir is not None:
            return Path(input_dir).is_dir()
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            return True  # nothing to look for: load_state raises naming what is missing
        return bool(numbered_checkpoints(Path(config.project_dir) / "checkpoints"))


def _publish_with_manifest(target: SaveTarget, checksums: Checksums) -> None:
    """Record the folder's files in its manifest, then publish it (a no-op where another process published it)."""
    if target.temporary.is_dir():
        with abandon_on_error(target.temporary):
            write_manifest(target.temporary, checksums)
    publish(target)


def _weights_only(weights_only: bool | None, load_kwargs: dict[str, Any]) -> bool:
    """Whether ``load_state`` reads its files weights-only; an explicit choice also goes into ``load_kwargs``.

    ``load_kwargs={"weights_only": False}`` (Accelerate's way) opts in for the files it reaches (optimizers,
    schedulers, stateful loaders) only; ``weights_only=False`` for every file of the folder.

    Raises:
        ValueError: When the two say different things.

    """
    given = load_kwargs.get("weights_only")
    if weights_only is None:
        return True
    if given is not None and bool(given) != weights_only:
        raise ValueError(
            f"load_state got weights_only={weights_only} and load_kwargs={{'weights_only': {given!r}}}: pass one"
            " of them (weights_only=False trusts every file of the folder)."
        )
    load_kwargs["weights_only"] = weights_only
    return weights_only


def _refuse_sharded(models: list[AcceleratedModule]) -> None:
    """Raise on every process (before any barrier) when a model has sharded (DTensor) parameters.

    Raises:
        ValueError: Naming the first sharded parameter and what to use instead.

    """
    from torch.distributed.tensor import DTensor

    sharded = [name for model in models for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"save_state cannot write the sharded (DTensor) weights of this strategy ({sharded[0]!r} is one); use"
            " accelerator.save_model(model, directory), which gathers them, or train with FSDP, whose checkpoints"
            " save_state writes."
        )
