"""The FSDP checkpoint layout, with Accelerate 1.15's names, written and read in one place.

Its users: ``save_state``'s FSDP models and optimizers (:class:`FSDPCheckpoint`), and Accelerate's ``save_fsdp_model``
/ ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` (public at ``lightning_accel.utils``).

By ``FullyShardedDataParallelPlugin.state_dict_type`` (model ``i``, optimizer ``i``):

- ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/``, ``torch.distributed.checkpoint``
  directories holding ``{"model": <state dict>}`` and ``{"optimizer": <state dict keyed by parameter name>}``, one
  shard file per process; a different number of processes can load them. Accelerate's functions with
  ``use_dcp=False`` write ``pytorch_model_fsdp_{i}_rank{r}.bin`` / ``optimizer_{i}_rank{r}.bin`` per process instead.
- ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_{i}.bin``) and ``optimizer.bin``
  (``optimizer_{i}.bin``), the gathered state dicts saved with ``torch.save`` by the main process.
- ``LOCAL_STATE_DICT`` (FSDP1, Accelerate's functions only): ``pytorch_model_fsdp_rank{r}.bin`` per process (FSDP's
  ``ShardedTensor`` objects, which a weights-only load cannot rebuild: loading them needs ``weights_only=False``).

Every read is weights-only unless the caller passes ``weights_only=False`` (a trusted folder; it warns naming each
file), and a DCP directory's ``.metadata`` may only name shard files inside the directory.

:class:`FSDPCheckpoint` (what ``acc_fsdp``'s ``checkpoint_engine()`` returns) goes through
``torch.distributed.checkpoint``'s state-dict API, which speaks FSDP1 and FSDP2, and loads whichever of the sharded and
full forms a folder holds. Accelerate's functions take the FSDP plugin, an accelerator (anything with
``num_processes``, ``process_index``, ``is_main_process``, ``is_fsdp2`` and ``wait_for_everyone``), the model and its
optimizer, as Accelerate's do; they accept this package's plugin (state-dict type as a name, configs derived when
unset) as well as Accelerate's, and prepared models and optimizers as well as the raw FSDP module and torch optimizer.
Under FSDP1 they use FSDP's ``state_dict_type`` context, as Accelerate does. One difference: on CPU full state dicts
are not "offloaded to CPU" (with that option FSDP1 crashes gathering a model there, which is where Accelerate's
full-state-dict save fails on CPU, and gathers an optimizer's state wrongly).

In the background (:meth:`FSDPCheckpoint.stage`), the state dicts are gathered in the call and copied into host
memory (a full one with :func:`~lightning_accel.checkpoint.background.host_copy`, shards with
``torch.distributed.checkpoint``'s own stager, which keeps them ``DTensor``/``ShardedTensor``); the thread then writes
them as :meth:`FSDPCheckpoint.save` does: ``torch.save`` on the main process, or ``torch.distributed.checkpoint.save``,
whose planning and metadata collectives run on the background saves' own gloo group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.checkpoint.background import background_group, host_copy
from lightning_accel.checkpoint.engines import (
    EngineCheckpoint,
    check_present,
    engine_module,
    indexed_name,
    refuse_options,
    torch_optimizer,
)
from lightning_accel.checkpoint.fsdp_policy import FSDPSettings, fsdp_settings, state_dict_options
from lightning_accel.logging import get_logger
from lightning_accel.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from lightning_accel.utils.modeling import is_peft_model
from lightning_accel.utils.modeling.checkpoint import contained_reader, read_checkpoint_file, weights_only_planner
from lightning_accel.utils.operations import _is_main_process, _process_rank
from lightning_accel.utils.other import load, torch_save, write_error

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FSDPCall",
    "FSDPCheckpoint",
    "FSDPFiles",
    "load_model",
    "load_optimizer",
    "save_model",
    "save_optimizer",
    "shard_failure",
]

logger = get_logger(__name__)


@dataclass(frozen=True)
class FSDPFiles:
    """Accelerate's names of model or optimizer ``index``'s state under ``root``."""

    root: Path
    kind: str  # "model" or "optimizer": also the state's key in a torch.distributed.checkpoint directory
    index: int

    @property
    def stem(self) -> str:
        """``pytorch_model_fsdp`` or ``optimizer``."""
        return FSDP_MODEL_NAME if self.kind == "model" else OPTIMIZER_NAME

    @property
    def sharded(self) -> Path:
        """The ``torch.distributed.checkpoint`` directory."""
        return self.root / f"{self.stem}_{self.index}"

    @property
    def full(self) -> Path:
        """The gathered ``torch.save`` file."""
        return self.root / indexed_name(self.stem, self.index, ".bin")

    def per_rank(self, rank: int) -> Path:
        """Process ``rank``'s file of a sharded state written without DCP."""
        return self.root / f"{self.stem}_{self.index}_rank{rank}.bin"

    def local(self, rank: int) -> Path:
        """Process ``rank``'s FSDP1 ``LOCAL_STATE_DICT`` file."""
        return self.root / f"{indexed_name(self.stem, self.index)}_rank{rank}.bin"

    def sharded_to_read(self) -> Path:
        """The DCP directory, or ``root`` itself when it already is that directory (Accelerate accepts both)."""
        return self.root if self.root.name == self.sharded.name else self.sharded


def write_state(
    state: Any, files: FSDPFiles, full: bool, rank: int, use_dcp: bool = True, group: ProcessGroup | None = None
) -> Path | None:
    """Write ``state``: one gathered file from process 0, a DCP directory, or (``use_dcp=False``) a file per process.

    A DCP directory is planned over ``group`` (``None``: the default group).

    Returns:
        What this process wrote (``None`` where it writes nothing, or its share of a DCP directory).

    """
    if full:
        if rank != 0:
            return None
        torch_save(state, files.full)
        return files.full
    if not use_dcp:
        torch_save(state, files.per_rank(rank))
        return None
    import torch.distributed.checkpoint as dcp

    files.sharded.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save({files.kind: state}, storage_writer=dcp.FileSystemWriter(files.sharded), process_group=group)
    except dcp.api.CheckpointException as error:
        raise shard_failure(error, files.sharded, rank) from error
    return files.sharded


def shard_failure(error: BaseException, directory: Path, rank: int) -> BaseException:
    """What a failed DCP save of ``directory`` raises on process ``rank`` instead of DCP's ``CheckpointException``.

    Its own failure where this process failed, a full disk or the file size limit named by
    :func:`~lightning_accel.utils.other.write_error`; else a ``RuntimeError`` naming the first process that failed
    and why. DCP raises its ``CheckpointException`` on every process, a ``BaseException`` that handlers of
    ``Exception`` (the removal of a failed save's folder) let pass.
    """
    failures: dict[int, tuple[BaseException, Any]] = getattr(error, "failures", {})
    if not failures:
        return RuntimeError(f"torch.distributed.checkpoint could not write {directory}: {error}")
    failed = rank if rank in failures else min(failures)
    cause = failures[failed][0]
    named = write_error(cause, directory) or cause
    if failed == rank:
        return named
    return RuntimeError(f"Process {failed} could not write its shard of {directory}: {named!r}")


def _dcp_read(directory: Path, key: str, shards: Any, weights_only: bool, flatten: bool = True) -> Any:
    """Read a DCP directory's ``key`` into ``shards`` (this process's state, which says what to read)."""
    import torch.distributed.checkpoint as dcp

    holder = {key: shards}
    # Re-nesting FSDP1's ShardedTensors would also turn the optimizer's param_groups into one unknown key.
    planner = weights_only_planner(dcp.DefaultLoadPlanner(flatten_sharded_tensors=flatten), directory, weights_only)
    read = lambda folder: dcp.load(holder, storage_reader=contained_reader(folder), planner=planner)  # noqa: E731
    read_checkpoint_file(directory, read)
    return holder[key]


def _torch_read(path: Path, weights_only: bool, map_location: str | None = None) -> Any:
    """One checkpoint file, weights-only unless opted out, named if it cannot be read."""
    return read_checkpoint_file(path, lambda p: load(p, map_location=map_location, weights_only=weights_only))


class FSDPCheckpoint(EngineCheckpoint):
    """``save_state``'s FSDP1 and FSDP2 models and optimizers, through ``torch.distributed.checkpoint``'s state dicts.

    Args:
        state_dict_type: ``"SHARDED_STATE_DICT"`` or ``"FULL_STATE_DICT"``: what ``save`` writes. FSDP1's
            ``LOCAL_STATE_DICT`` (per-process flat shards) makes ``save`` and ``load`` raise ``ValueError``.
        after_load: Called with each module once its weights are loaded (the strategy's: e.g. refreshing fp8
            scales precomputed for the weights before the load).
        state_dict_config: The plugin's model state-dict config as the user set it (its ``offload_to_cpu`` is
            honoured), or ``None``.
        optim_state_dict_config: The same for the optimizers.

    """

    def __init__(
        self,
        state_dict_type: str,
        after_load: Callable[[Module], None] | None = None,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> None:
        self.state_dict_type = state_dict_type
        self.full = state_dict_type == "FULL_STATE_DICT"
        self.after_load = after_load
        self.configs = {"model": state_dict_config, "optimizer": optim_state_dict_config}

    def _check(self, options: dict[str, Any]) -> None:
        refuse_options("FSDP", options)
        if self.state_dict_type not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            raise ValueError(
                "save_state/load_state write FSDP checkpoints as SHARDED_STATE_DICT or FULL_STATE_DICT, got"
                f" state_dict_type={self.state_dict_type!r}. Set FullyShardedDataParallelPlugin(state_dict_type="
                "'SHARDED_STATE_DICT')."
            )

    def _options(self, module: Module, kind: str) -> Any:
        return state_dict_options(module, self.full, self.configs[kind])

    writes_in_background: ClassVar[bool] = True

    def save(self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any) -> None:
        """Write each model and optimizer as shards (a directory each) or as one gathered file."""
        self._check(kwargs)
        for state, files in self._states(models, optimizers, target):
            write_state(state, files, self.full, _process_rank())

    def stage(
        self, models: Sequence[Module], optimizers: Sequence[Any], target: Path, **kwargs: Any
    ) -> Callable[[], None]:
        """Gather the state dicts :meth:`save` writes into host memory; return their writing.

        The writing runs ``torch.distributed.checkpoint``'s collectives (sharded states) on
        :func:`~lightning_accel.checkpoint.background.background_group`, made here where it is new.
        """
        self._check(kwargs)
        group = None if self.full else background_group()
        staged = [(self._host(state), files) for state, files in self._states(models, optimizers, target)]
        rank = _process_rank()

        def write() -> None:
            for state, files in staged:
                write_state(state, files, self.full, rank, group=group)

        return write

    def _host(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host copy of a state dict: a gathered one's tensors, or shards as DCP's ``async_save`` stages them."""
        if self.full:
            return host_copy(state)
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return dict(BlockingAsyncStager().stage(state))

    def _states(
        self, models: Sequence[Module], optimizers: Sequence[Any], target: Path
    ) -> Iterator[tuple[dict[str, Any], FSDPFiles]]:
        """Each model's then each optimizer's state dict (gathered: collective) with its files, one at a time."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        modules = [engine_module(m) for m in models]
        for i, module in enumerate(modules):
            yield get_model_state_dict(module, options=self._options(module, "model")), FSDPFiles(target, "model", i)
        for i, optimizer in enumerate(optimizers):
            raw = torch_optimizer(optimizer)
            module = _owner(modules, raw)
            state = get_optimizer_state_dict(module, raw, options=self._options(module, "optimizer"))
            yield dict(state), FSDPFiles(target, "optimizer", i)

    def load(
        self,
        models: Sequence[Module],
        optimizers: Sequence[Any],
        source: Path,
        *,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> None:
        """Load shards or gathered files (whichever ``source`` holds) into the sharded models and optimizers.

        Raises:
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file or entry, naming it.
            ValueError: If ``source`` lacks a file, or a DCP directory names a file outside itself.

        """
        self._check(kwargs)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        model_files = [FSDPFiles(source, "model", i) for i in range(len(models))]
        optimizer_files = [FSDPFiles(source, "optimizer", i) for i in range(len(optimizers))]
        check_present(
            source,
            [(f"weights for model {i}", [f.sharded, f.full]) for i, f in enumerate(model_files)]
            + [(f"state for optimizer {i}", [f.sharded, f.full]) for i, f in enumerate(optimizer_files)],
        )
        modules = [engine_module(m) for m in models]
        for module, files in zip(modules, model_files, strict=True):
            state, options = _read(files, partial(_model_shards, module), weights_only)
            set_model_state_dict(module, state, options=options)
            if self.after_load is not None:
                self.after_load(module)
        for optimizer, files in zip(optimizers, optimizer_files, strict=True):
            raw = torch_optimizer(optimizer)
            module = _owner(modules, raw)
            state, options = _read(files, partial(_optimizer_shards, module, raw), weights_only)
            set_optimizer_state_dict(module, raw, state, options=options)

    def full_state_dict(self, model: Module, prepared: Sequence[Module]) -> dict[str, Any]:
        """The gathered weights on the main process's CPU, as Accelerate returns them under FSDP."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = engine_module(model, prepared)
        state = get_model_state_dict(module, options=state_dict_options(module, full=True))
        return dict(state) if _is_main_process() else {}


def _read(files: FSDPFiles, layout: Callable[[], dict[str, Any]], weights_only: bool) -> tuple[dict[str, Any], Any]:
    """A state dict to load and the options to load it with, from a DCP directory or a ``torch.save`` file.

    A sharded directory is read into this process's shards (``layout()`` gives them); a full file is read by the
    main process only and broadcast while loading.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if files.sharded.is_dir():
        state = _dcp_read(files.sharded, files.kind, layout(), weights_only, flatten=False)
        return state, StateDictOptions(full_state_dict=False)
    state = _torch_read(files.full, weights_only, map_location="cpu") if _is_main_process() else {}
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


# Accelerate's functions (their signatures and documentation are at Accelerate's path, utils/fsdp_utils.py).


class Processes(Protocol):
    """What Accelerate's FSDP checkpoint functions read from the accelerator they are given."""

    num_processes: int
    process_index: int
    is_main_process: bool
    is_fsdp2: bool

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""


@dataclass(frozen=True)
class FSDPCall:
    """The arguments of one call of Accelerate's FSDP checkpoint functions (every process makes it)."""

    fsdp_plugin: Any  # this package's FullyShardedDataParallelPlugin or Accelerate's
    accelerator: Processes
    model: Module
    directory: str | os.PathLike[str]
    index: int = 0
    adapter_only: bool = False
    use_dcp: bool = True
    weights_only: bool = True  # False: a trusted folder, unpickled in full (with a warning naming each file)

    def begin(self, kind: str) -> tuple[FSDPSettings, Module, FSDPFiles]:
        """The plugin's settings, the FSDP module, and the files of this call's model or optimizer."""
        return (
            fsdp_settings(self.fsdp_plugin),
            engine_module(self.model),
            FSDPFiles(Path(self.directory), kind, self.index),
        )


def _model_state(module: Module, adapter_only: bool, options: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if adapter_only and is_peft_model(module):
        if options is not None and options.full_state_dict:
            return dict(get_model_state_dict(module, options=replace(options, ignore_frozen_params=True)))
        from peft import get_peft_model_state_dict

        adapter = cast(str, module.active_adapter)  # a PeftModel's (the module type does not say so)
        return dict(get_peft_model_state_dict(module, adapter_name=adapter))
    if options is not None:
        return dict(get_model_state_dict(module, options=options))
    return dict(module.state_dict())


def _set_model_state(module: Module, state: dict[str, Any], adapter_only: bool, options: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if adapter_only and is_peft_model(module):
        if options is not None and options.full_state_dict:
            return set_model_state_dict(module, state, options=replace(options, strict=False))
        from peft import set_peft_model_state_dict

        return set_peft_model_state_dict(module, state, adapter_name=module.active_adapter)
    if options is not None:
        return set_model_state_dict(module, state, options=options)
    return module.load_state_dict(state)


def _optimizer_state(settings: FSDPSettings, module: Module, optimizer: Optimizer, options: Any) -> Any:
    if settings.version == 2:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer, options=options)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.optim_state_dict(module, optimizer)


def _read_accelerate_state(
    files: FSDPFiles,
    settings: FSDPSettings,
    reading: tuple[int, bool, bool],
    shards: Callable[[], Any],
    weights_only: bool,
) -> Any:
    """What Accelerate's load functions read, by the plugin's type.

    Args:
        files: The model's or optimizer's names.
        settings: The plugin's settings.
        reading: This process's rank, whether it reads a full file (else ``{}``), and ``use_dcp``.
        shards: This process's state, which says what to read from a DCP directory.
        weights_only: ``False`` unpickles a trusted folder's files in full.

    """
    rank, reads_full, use_dcp = reading
    if settings.full:
        return _torch_read(files.full, weights_only) if reads_full else {}
    if settings.state_dict_type.name == "LOCAL_STATE_DICT" and files.kind == "model":
        # FSDP1's local shards are ShardedTensors, which a weights-only load refuses (Accelerate fails here too):
        # they load with weights_only=False.
        return _torch_read(files.local(rank), weights_only)
    if use_dcp:
        return _dcp_read(files.sharded_to_read(), files.kind, shards(), weights_only)
    return _torch_read(files.per_rank(rank), weights_only)


def save_model(call: FSDPCall) -> None:
    """``save_fsdp_model``: write the model's state, as Accelerate does."""
    settings, module, files = call.begin("model")
    os.makedirs(call.directory, exist_ok=True)
    settings.gather_rules(call.accelerator.num_processes, module)
    rank = call.accelerator.process_index
    with settings.context(module):
        state = _model_state(module, call.adapter_only, settings.options(module))
        if settings.state_dict_type.name == "LOCAL_STATE_DICT":
            torch_save(state, files.local(rank))
        elif (written := write_state(state, files, settings.full, rank, call.use_dcp)) is not None:
            logger.info(f"Model saved to {written}")


def load_model(call: FSDPCall) -> Any:
    """``load_fsdp_model``: load what :func:`save_model` (or Accelerate's) wrote; returns what loading returned.

    Raises:
        ValueError: Under FSDP1 with ``FULL_STATE_DICT`` on a process other than 0 when the model is not FSDP-wrapped
            and ``sync_module_states`` is off (that process would keep its own weights).

    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    settings, module, files = call.begin("model")
    accelerator = call.accelerator
    rank, fsdp2 = accelerator.process_index, accelerator.is_fsdp2
    accelerator.wait_for_everyone()
    settings.gather_rules(accelerator.num_processes, module)
    options = settings.options(module)
    with settings.context(module):
        if settings.full and type(module) is not FullyShardedDataParallel and rank != 0 and not fsdp2:
            if not settings.sync_module_states and settings.version == 1:
                raise ValueError(
                    "Set the `sync_module_states` flag to `True` so that model states are synced across "
                    "processes when initializing FSDP object"
                )
            return None
        reads_full = not fsdp2 or accelerator.is_main_process  # FSDP2 broadcasts process 0's (broadcast_from_rank0)
        shards = partial(_model_state, module, call.adapter_only, options)
        state = _read_accelerate_state(files, settings, (rank, reads_full, call.use_dcp), shards, call.weights_only)
        result = _set_model_state(module, state, call.adapter_only, options)
    accelerator.wait_for_everyone()
    return result


def save_optimizer(call: FSDPCall, optimizer: Any) -> None:
    """``save_fsdp_optimizer``: write the optimizer's state (keyed by parameter name), as Accelerate does."""
    settings, module, files = call.begin("optimizer")
    os.makedirs(call.directory, exist_ok=True)
    settings.no_offload_on_cpu(module)
    with settings.context(module):
        state = _optimizer_state(settings, module, torch_optimizer(optimizer), settings.options(module))
        written = write_state(state, files, settings.full, call.accelerator.process_index, call.use_dcp)
        if written is not None:
            logger.info(f"Optimizer state saved in {written}")


def load_optimizer(call: FSDPCall, optimizer: Any) -> None:
    """``load_fsdp_optimizer``: load what :func:`save_optimizer` (or Accelerate's) wrote into ``optimizer``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    settings, module, files = call.begin("optimizer")
    raw, rank = torch_optimizer(optimizer), call.accelerator.process_index
    call.accelerator.wait_for_everyone()
    settings.no_offload_on_cpu(module)
    options = settings.options(module)
    with settings.context(module):
        reads_full = rank == 0 or not getattr(settings.optim_state_dict_config, "rank0_only", False)
        shards = partial(_optimizer_state, settings, module, raw, options)
        state: Any = None  # on the processes that read no gathered file
        if reads_full or not settings.full:
            reading = (rank, reads_full, call.use_dcp)
            state = _read_accelerate_state(files, settings, reading, shards, call.weights_only)
        if settings.version == 1:
            flat = FullyShardedDataParallel.optim_state_dict_to_load(model=module, optim=raw, optim_state_dict=state)
            raw.load_state_dict(flat)
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(module, raw, state, options=options)
    call.accelerator.wait_for_everyone()
