"""The ``Accelerator``'s checkpoint surface: registered objects and hooks, state dicts, ``save_model``, ``save_state``.

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
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from lightning.fabric import Fabric
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from lightning_accel._shim.module import AcceleratedModule
from lightning_accel.checkpoint import state_files
from lightning_accel.checkpoint.engines import EngineCheckpoint
from lightning_accel.checkpoint.folders import (
    SaveTarget,
    numbered_checkpoints,
    on_disk_managers,
    publish,
    remove_stale,
    rotate,
    stage,
)
from lightning_accel.checkpoint.loaders import loader_positions, save_loader_states
from lightning_accel.checkpoint.node_copies import complete_on_each_node
from lightning_accel.checkpointing import accelerate_sampler, save_custom_state, shard_state_dict
from lightning_accel.checkpointing import save_model as write_model_files
from lightning_accel.config import InitProcessGroupKwargs, ProjectConfiguration
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.state.shared_errors import raise_on_every_process, require_every_process, run_where
from lightning_accel.utils.constants import OPTIMIZER_NAME, SCHEDULER_NAME
from lightning_accel.utils.modeling.offloaded import get_state_dict_offloaded_model, has_offloaded_params
from lightning_accel.utils.other import extract_model_from_parallel, save

if TYPE_CHECKING:
    import torch

    from lightning_accel.data_loader import DataLoaderShard
    from lightning_accel.enums import DistributedType
    from lightning_accel.optimizer import AcceleratedOptimizer
    from lightning_accel.scheduler import AcceleratedScheduler
    from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["CheckpointControl", "check_save_model_arguments"]


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


class CheckpointControl:
    """Accelerate's checkpoint methods, for the ``Accelerator``."""

    fabric: Fabric
    _strategy: ShimStrategy
    project_configuration: ProjectConfiguration
    step: int
    _models: list[AcceleratedModule]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[DataLoaderShard]
    _custom_objects: list[Any]
    _save_state_pre_hooks: OrderedDict[int, Callable[..., None]]
    _load_state_pre_hooks: OrderedDict[int, Callable[..., None]]
    init_handler: InitProcessGroupKwargs | None

    if TYPE_CHECKING:  # the Accelerator's, from ProcessControl and PrecisionMembers

        @property
        def is_main_process(self) -> bool: ...

        @property
        def is_local_main_process(self) -> bool: ...

        @property
        def process_index(self) -> int: ...

        @property
        def scaler(self) -> torch.amp.GradScaler | None: ...

        @property
        def distributed_type(self) -> DistributedType: ...

        def wait_for_everyone(self) -> None: ...

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) in ``save_state``/``load_state``.

        Raises:
            ValueError: Naming the objects that lack either method.

        """
        invalid = [
            f"Item at index {i} ({type(o).__name__})"
            for i, o in enumerate(objects)
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if invalid:
            raise ValueError(
                f"Objects to checkpoint need `state_dict` and `load_state_dict` methods; these lack them: {invalid}."
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in ``save_state`` before the weights are written.

        The hook may pop entries from ``weights`` (and ``models``) to save them its own way.
        """
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in ``load_state`` before the weights are loaded (it may pop models)."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    def get_state_dict(self, model: Module, unwrap: bool = True) -> dict[str, Any]:
        """The model's full state dict (on every process, or on the main process only for sharded weights).

        Sharded weights are gathered to the main process's CPU, as Accelerate does under FSDP and DeepSpeed ZeRO-3;
        the other processes get ``{}`` (collective: every process calls it). ZeRO-3 needs
        ``DeepSpeedPlugin(zero3_save_16bit_model=True)``, as in Accelerate.

        With ``unwrap=False`` it is the strategy-wrapped module's own state dict (DDP keys keep ``module.``).

        Raises:
            ValueError: Under ZeRO-3 without ``zero3_save_16bit_model``.

        """
        if not unwrap:
            return dict(self.fabric.strategy.get_module_state_dict(fabric_forward_module(model)))
        engine = self._strategy.checkpoint_engine()
        if engine is not None:
            require_every_process("get_state_dict", self._why_collective(), self._group_timeout())
            return engine.full_state_dict(model, self._models)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        module = extract_model_from_parallel(model)
        if any(has_offloaded_params(m) for m in module.modules()):  # big-model hooks keep weights on meta/disk
            return get_state_dict_offloaded_model(module)
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        if sharded:
            why = "its weights are sharded DTensors, gathered over every process"
            require_every_process("get_state_dict", why, self._group_timeout())
        options = StateDictOptions(full_state_dict=True, cpu_offload=sharded)  # torch gathers for any parallelism
        return dict(get_model_state_dict(module, options=options))

    def save_model(
        self,
        model: Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's weights: ``model.safetensors``, or shards and an index past ``max_shard_size``.

        File names and the index are Accelerate's (Hugging Face's), so ``from_pretrained``-style loaders read them.
        The arguments are checked on every process before any collective, and an error while the main process
        writes is raised on every process (none is left waiting).

        Raises:
            TypeError: For a ``model`` that is not a module, or a non-boolean ``safe_serialization``.
            ValueError: For a ``save_directory`` that is a file, or a ``max_shard_size`` that is not a positive size.

        """
        check_save_model_arguments(model, save_directory, max_shard_size, safe_serialization)
        sharded = self._strategy.checkpoint_engine() is not None
        state = self.get_state_dict(model)  # collective under sharded engines only

        def write() -> None:
            write_model_files(
                state, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
            )

        if sharded:
            run_where(self.is_main_process, write, "save_model")
        elif self.is_main_process:  # replicated weights: callable from the main process alone, as Accelerate's
            write()

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """Save ``obj`` once (per node with ``save_on_each_node``); see :func:`lightning_accel.utils.other.save`."""
        save(obj, f, self.project_configuration.save_on_each_node, safe_serialization=safe_serialization)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, RNG states and registered objects with Accelerate's file names.

        Under FSDP and DeepSpeed the engine writes the models and optimizers (sharded or gathered, by the plugin);
        ``save_model_func_kwargs`` go to DeepSpeed's ``save_checkpoint``. Returns the checkpoint directory. See
        :func:`lightning_accel.checkpointing.save_state`.

        Where the state is replicated (one device, DDP), a save into ``output_dir`` is Accelerate's call from any
        subset of the processes: nothing waits for another process, so ``if accelerator.is_main_process:
        accelerator.save_state(dir)`` works; the main process (each node's with ``save_on_each_node``) writes the
        shared files, every calling process its random states. Where each process holds a shard (FSDP, DeepSpeed),
        or with automatic naming (Accelerate waits for every process there too), every process must call it; one that
        does not is named in an error within the process group's timeout, instead of a hang.

        Unlike Accelerate's, the save is atomic: files are written into ``.<name>.incomplete`` beside the folder,
        which gets its name once complete; old folders are rotated out only then. See
        :mod:`lightning_accel.checkpoint.folders`. With ``save_on_each_node`` on node-local disks and a sharded
        state, each node is first sent the files it lacks (other nodes' shards, the metadata written on the main
        process only), so every node's folder is a whole checkpoint; see :mod:`lightning_accel.checkpoint.node_copies`.
        A process that names another ``output_dir`` than the main process's gets its own random states and loader
        states there, as Accelerate has every process write them.
        """
        engine = self._engine(save_model_func_kwargs)
        if engine is None and not self.project_configuration.automatic_checkpoint_naming:
            return self._save_alone(output_dir, safe_serialization)
        why = self._why_collective() if engine is not None else "automatic naming counts the saves of every process"
        require_every_process("save_state", why, self._group_timeout())
        return self._save_together(engine, output_dir, safe_serialization, save_model_func_kwargs)

    def _save_alone(self, output_dir: str | os.PathLike[str] | None, safe_serialization: bool) -> str:
        """``save_state`` without a collective: the publisher writes and publishes, the others stage their files."""
        config = self.project_configuration
        publisher = self.is_local_main_process if config.save_on_each_node else self.is_main_process
        final = state_files.choose_target(config, output_dir)
        target = SaveTarget(final, publisher=0 if self.is_main_process else self.process_index)
        if publisher:
            remove_stale(target)
            self._write_shared_files(target.temporary, None, safe_serialization)
            self._write_process_states(target.temporary)
            publish(target)
        else:
            stage(
                target,
                self.process_index,
                own=self._write_process_states,
                defaults=lambda folder: save_loader_states(self._dataloaders, folder),
            )
        config.iteration += 1
        return str(final)

    def _save_together(
        self,
        engine: EngineCheckpoint | None,
        output_dir: str | os.PathLike[str] | None,
        safe_serialization: bool,
        engine_kwargs: dict[str, Any],
    ) -> str:
        """``save_state`` on every process: the main process chooses the folder, every one writes, it is published."""
        config = self.project_configuration
        chosen: list[Any] = [None, None]
        if self.is_main_process:
            try:
                chosen[0] = state_files.choose_target(config, output_dir)
            except ValueError as err:
                chosen[1] = err
        chosen = cast("list[Any]", self.fabric.broadcast(chosen, src=0))
        raise_on_every_process(chosen[1], "save_state")  # the broadcast already reached every process
        target = SaveTarget(Path(chosen[0]))
        self._on_disk_managers(lambda: remove_stale(target), "save_state (clearing an interrupted save)")
        target.temporary.mkdir(parents=True, exist_ok=True)
        if engine is not None:
            engine.save(self._models, self._optimizers, target.temporary, **engine_kwargs)
            self.wait_for_everyone()
        writer = self.is_local_main_process if config.save_on_each_node else self.is_main_process
        if writer:
            self._write_shared_files(target.temporary, engine, safe_serialization)
        self._write_process_states(target.temporary)
        self.wait_for_everyone()
        config.iteration += 1
        if config.save_on_each_node:  # node-local disks: each node gets the files (shards, metadata) it lacks
            complete_on_each_node(target.temporary, node_manager=self.is_local_main_process, what="save_state")
        self._on_disk_managers(lambda: publish(target), "save_state (publishing the checkpoint)")
        self._write_own_folder(output_dir, target.final)
        if config.automatic_checkpoint_naming:
            self._on_disk_managers(lambda: rotate(target.final.parent, config.total_limit), "save_state (rotation)")
        return str(target.final)

    def _write_shared_files(self, folder: Path, engine: EngineCheckpoint | None, safe_serialization: bool) -> None:
        """The files one process writes: the weights and optimizers (unless an engine wrote them), the rest."""
        folder.mkdir(parents=True, exist_ok=True)
        # The users' modules, without the strategy's wrapper; an engine saved its own (hooks get none).
        weights = [model.state_dict() for model in self._models] if engine is None else []
        user_models = [model.module for model in self._models]  # hooks see the users' modules, as Accelerate's
        for hook in list(self._save_state_pre_hooks.values()):
            hook(user_models, weights, str(folder))  # a hook may pop entries to save them its own way
        state_files.write_shared_files(
            folder,
            weights,
            self._optimizers if engine is None else [],
            self._schedulers,
            self._dataloaders,
            self.scaler,
            safe_serialization,
            accelerate_sampler,
        )
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(obj, folder, i, self.project_configuration.save_on_each_node)

    def _write_process_states(self, folder: Path) -> None:
        state_files.write_process_states(folder, self.process_index, self.step, loader_positions(self._dataloaders))

    def _write_own_folder(self, requested: str | os.PathLike[str] | None, written: Path) -> None:
        """Where this process named another folder than ``written`` (the main process's), put its own files there.

        Its own files are its random states and the states of its stateful loaders (what Accelerate has every process
        write); the shared files stay in ``written`` only, as Accelerate writes them on the main process only.
        """
        if requested is None or Path(requested).resolve() == written.resolve():
            return
        folder = Path(requested)
        folder.mkdir(parents=True, exist_ok=True)
        self._write_process_states(folder)
        save_loader_states(self._dataloaders, folder)

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
                    f" save_checkpoint/load_checkpoint, but this run is {self.distributed_type}; drop them."
                )
            _refuse_sharded(list(self._models))
        return engine

    def _group_timeout(self) -> timedelta | None:
        return self.init_handler.timeout if self.init_handler is not None else None

    def _why_collective(self) -> str:
        return f"under {self.distributed_type} each process holds a shard of the state"

    def _on_disk_managers(self, action: Callable[[], None], what: str) -> None:
        other_node_manager = (
            self.project_configuration.save_on_each_node and self.is_local_main_process and not self.is_main_process
        )
        on_disk_managers(action, is_main=self.is_main_process, other_node_manager=other_node_manager, what=what)

    @overload
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: Literal[False] = False,
        resume_position: bool = False,
        **load_model_func_kwargs: Any,
    ) -> str: ...

    @overload
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool,
        resume_position: bool = False,
        **load_model_func_kwargs: Any,
    ) -> str | None: ...

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool = False,
        resume_position: bool = False,
        **load_model_func_kwargs: Any,
    ) -> str | None:
        """Load a checkpoint written by :meth:`save_state` (or by HF accelerate); returns its directory.

        ``load_kwargs`` go to the ``torch.load`` of the optimizer, scheduler and loader files, and
        ``load_model_func_kwargs`` to DeepSpeed's ``load_checkpoint``. With ``missing_ok=True`` (not in Accelerate),
        nothing to load (no ``input_dir`` folder; with automatic naming, no ``checkpoint_<i>`` yet) returns ``None``
        instead of raising.

        Each prepared data loader gets back its epoch (Accelerate restores none), and its next iteration starts at
        the epoch's first batch, as Accelerate's: the loop skips the batches it already trained on itself
        (``skip_first_batches``, or ``continue`` while ``step < resume_step`` as diffusers' scripts do). With
        ``resume_position=True`` (not in Accelerate) the loaders also resume at the batch they had reached, for a
        loop that does not skip: one ``accelerator.load_state(missing_ok=True, resume_position=True)`` before such a
        loop starts a fresh run and resumes one that ``lightning-accel launch --max_restarts N`` restarted exactly.
        ``skip_first_batches`` after a ``resume_position=True`` load skips from the epoch's first batch too.
        """
        if missing_ok and not self._has_checkpoint(input_dir):
            return None
        engine = self._engine(load_model_func_kwargs)
        if engine is not None:
            require_every_process("load_state", self._why_collective(), self._group_timeout())
        config = self.project_configuration
        source = state_files.latest_source(config, input_dir)
        models = list(self._models) if engine is None else []  # an engine loads its models itself
        user_models = [model.module for model in models]
        for hook in list(self._load_state_pre_hooks.values()):
            hook(user_models, str(source))  # a hook may pop models to load them its own way
        kept = {id(module) for module in user_models}
        scaler = self.scaler
        if scaler is not None and (source / "scaler.pt").is_file():
            state_files.load_scaler(scaler, source)  # before optimizers, which FSDP2 may step
        if engine is not None:
            engine.load(self._models, self._optimizers, source, **load_model_func_kwargs)
        for i, model in enumerate(m for m in models if id(m.module) in kept):
            state_files.load_model_weights(model, source, i)
        extra = dict(load_kwargs or {})
        state_files.load_state_dicts(self._optimizers if engine is None else [], source, OPTIMIZER_NAME, **extra)
        state_files.load_state_dicts(self._schedulers, source, SCHEDULER_NAME, **extra)
        state_files.load_custom_objects(self._custom_objects, source)
        self._load_process_states(source, extra, resume_position)
        config.iteration = state_files.next_iteration(config, source)
        return str(source)

    def _load_process_states(self, source: Path, load_kwargs: dict[str, Any], positions: bool) -> None:
        """Restore this process's random states, its loaders' epochs (and positions) and stateful states, the step."""
        state_files.load_samplers(self._dataloaders, source, accelerate_sampler)
        hint = " (was the run saved by fewer processes, or did only some of its processes call save_state?)"
        states = state_files.load_process_states(
            source, self.process_index, self._dataloaders, hint, positions=positions, **load_kwargs
        )
        if states is not None:
            self.step = int(states.get("step", 0))

    def _has_checkpoint(self, input_dir: str | os.PathLike[str] | None) -> bool:
        config = self.project_configuration
        if input_dir is not None:
            return Path(input_dir).is_dir()
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            return True  # nothing to look for: load_state raises naming what is missing
        return bool(numbered_checkpoints(Path(config.project_dir) / "checkpoints"))


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
