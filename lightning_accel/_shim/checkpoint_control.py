"""The ``Accelerator``'s checkpoint surface: registered objects and hooks, state dicts, ``save_model``, ``save_state``.

The files and their names are :mod:`lightning_accel.checkpointing`'s; sharded engines (FSDP, DeepSpeed) write theirs
through :mod:`lightning_accel._shim.sharded_checkpoint`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from lightning.fabric import Fabric
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from lightning_accel import checkpointing
from lightning_accel._shim.checkpoint_publish import (
    SaveTarget,
    on_disk_managers,
    publish,
    remove_stale,
    rotate,
)
from lightning_accel._shim.module import AcceleratedModule
from lightning_accel._shim.process_files import write_own_folder
from lightning_accel.checkpointing import checkpoint_folders, choose_target, write_state
from lightning_accel.config import ProjectConfiguration
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.state.shared_errors import raise_on_every_process, run_where
from lightning_accel.utils.modeling.offloaded import get_state_dict_offloaded_model, has_offloaded_params
from lightning_accel.utils.node_copies import complete_on_each_node
from lightning_accel.utils.other import extract_model_from_parallel, save

if TYPE_CHECKING:
    from lightning_accel.accelerator import Accelerator

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
        checkpointing.shard_state_dict({}, "{suffix}", size)  # parses the size exactly as the writer will
    except ValueError:
        return False
    return size > 0 if isinstance(size, int) else float(size.strip()[:-2]) > 0


class CheckpointControl:
    """Accelerate's checkpoint methods, for the ``Accelerator``."""

    fabric: Fabric
    project_configuration: ProjectConfiguration
    _models: list[AcceleratedModule]
    _custom_objects: list[Any]
    _save_state_pre_hooks: OrderedDict[int, Callable[..., None]]
    _load_state_pre_hooks: OrderedDict[int, Callable[..., None]]

    if TYPE_CHECKING:  # the Accelerator's, from ProcessControl

        @property
        def is_main_process(self) -> bool: ...

        @property
        def is_local_main_process(self) -> bool: ...

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
        from lightning_accel._shim.sharded_checkpoint import engine_checkpoint

        engine = engine_checkpoint(self.fabric.strategy)
        if engine is not None:
            return engine.full_state_dict(model, self._models)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        module = extract_model_from_parallel(model)
        if any(has_offloaded_params(m) for m in module.modules()):  # big-model hooks keep weights on meta/disk
            return get_state_dict_offloaded_model(module)
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
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
        state = self.get_state_dict(model)  # collective under sharded engines

        def write() -> None:
            checkpointing.save_model(
                state, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
            )

        run_where(self.is_main_process, write, "save_model")

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

        Unlike Accelerate's, the save is atomic: the main process chooses the folder and tells the others, everyone
        writes into ``.<name>.incomplete`` beside it, and the folder gets its name once every process is done (on
        each node's disk with ``save_on_each_node``); old folders are rotated out only then. See
        :mod:`lightning_accel._shim.checkpoint_publish`. With ``save_on_each_node`` on node-local disks, each node
        is first sent the files it lacks (other nodes' shards, the metadata written on the main process only), so
        every node's folder is a whole checkpoint; see :mod:`lightning_accel.utils.node_copies`. A process that
        names another ``output_dir`` than the main process's also gets its own random states and loader states there,
        as Accelerate writes them (see :mod:`lightning_accel._shim.process_files`).
        """
        config = self.project_configuration
        chosen: list[Any] = [None, None]
        if self.is_main_process:
            try:
                chosen[0] = choose_target(config, output_dir)
            except ValueError as err:
                chosen[1] = err
        chosen = cast("list[Any]", self.fabric.broadcast(chosen, src=0))
        raise_on_every_process(chosen[1], "save_state")  # the broadcast already reached every process
        target = SaveTarget(Path(chosen[0]))
        self._on_disk_managers(lambda: remove_stale(target), "save_state (clearing an interrupted save)")
        write_state(cast("Accelerator", self), target.temporary, safe_serialization, **save_model_func_kwargs)
        if config.save_on_each_node:  # node-local disks: each node gets the files (shards, metadata) it lacks
            complete_on_each_node(target.temporary, node_manager=self.is_local_main_process, what="save_state")
        self._on_disk_managers(lambda: publish(target), "save_state (publishing the checkpoint)")
        write_own_folder(cast("Accelerator", self), output_dir, target.final)
        if config.automatic_checkpoint_naming:
            self._on_disk_managers(lambda: rotate(target.final.parent, config.total_limit), "save_state (rotation)")
        return str(target.final)

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
        **load_model_func_kwargs: Any,
    ) -> str: ...

    @overload
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool,
        **load_model_func_kwargs: Any,
    ) -> str | None: ...

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        missing_ok: bool = False,
        **load_model_func_kwargs: Any,
    ) -> str | None:
        """Load a checkpoint written by :meth:`save_state` (or by HF accelerate); returns its directory.

        ``load_kwargs`` go to the ``torch.load`` of the optimizer, scheduler and loader files, and
        ``load_model_func_kwargs`` to DeepSpeed's ``load_checkpoint``. With ``missing_ok=True`` (not in Accelerate),
        nothing to load (no ``input_dir`` folder; with automatic naming, no ``checkpoint_<i>`` yet) returns ``None``
        instead of raising, so one ``accelerator.load_state(missing_ok=True)`` before the loop starts a fresh run
        and resumes one that ``lightning-accel launch --max_restarts N`` restarted.
        """
        if missing_ok and not self._has_checkpoint(input_dir):
            return None
        accelerator = cast("Accelerator", self)
        return checkpointing.load_state(accelerator, input_dir, load_kwargs, **load_model_func_kwargs)

    def _has_checkpoint(self, input_dir: str | os.PathLike[str] | None) -> bool:
        config = self.project_configuration
        if input_dir is not None:
            return Path(input_dir).is_dir()
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            return True  # nothing to look for: load_state raises naming what is missing
        return bool(checkpoint_folders(Path(config.project_dir) / "checkpoints"))
