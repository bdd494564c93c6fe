"""Accelerate's FSDP model and optimizer checkpoint functions, with its file names and contents.

``save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` take the FSDP plugin, an
accelerator (anything with ``num_processes``, ``process_index``, ``is_main_process`` and ``wait_for_everyone``), the
FSDP-wrapped model and its optimizer, as Accelerate's do. By the plugin's ``state_dict_type`` (model ``i``):

- ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_{i}.bin``) and ``optimizer.bin``
  (``optimizer_{i}.bin``), the gathered state dicts, written by process 0 with ``torch.save``;
- ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/``, ``torch.distributed.checkpoint``
  directories holding ``{"model": ...}`` and ``{"optimizer": ...}`` (with ``use_dcp=False``, one
  ``pytorch_model_fsdp_{i}_rank{r}.bin`` / ``optimizer_{i}_rank{r}.bin`` per process instead);
- ``LOCAL_STATE_DICT`` (FSDP1 only): ``pytorch_model_fsdp_rank{r}.bin`` per process (FSDP's ``ShardedTensor``
  objects, unpickled in full when loaded: Accelerate's ``weights_only`` load cannot read them back).

They accept this package's :class:`~lightning_accel.utils.FullyShardedDataParallelPlugin` (state-dict type as a name,
configs derived when unset) as well as one with torch's objects (Accelerate's), and models and optimizers returned by
``Accelerator.prepare`` as well as the raw FSDP module and torch optimizer. One difference: on CPU full state dicts
are not "offloaded to CPU" (with that option FSDP1 crashes gathering a model there, which is where Accelerate's
full-state-dict save fails on CPU, and gathers an optimizer's state wrongly).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch

from lightning_accel.logging import get_logger
from lightning_accel.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from lightning_accel.utils.modeling import is_peft_model
from lightning_accel.utils.modeling.checkpoint import read_checkpoint_file

__all__ = ["load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model", "save_fsdp_optimizer"]

logger = get_logger(__name__)


@dataclass
class _Settings:
    """What the functions read from an FSDP plugin, as torch objects."""

    version: int
    state_dict_type: Any  # torch.distributed.fsdp.StateDictType
    state_dict_config: Any
    optim_state_dict_config: Any
    sync_module_states: bool


def _settings(fsdp_plugin: Any) -> _Settings:
    """The plugin's state-dict settings, from this package's plugin (names, derived configs) or Accelerate's."""
    from torch.distributed.fsdp import StateDictType

    if hasattr(fsdp_plugin, "torch_state_dict_configs"):
        model_config, optim_config = fsdp_plugin.torch_state_dict_configs()
        state_dict_type = fsdp_plugin.torch_state_dict_type()
    else:
        model_config, optim_config = fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
        state_dict_type = fsdp_plugin.state_dict_type
        if isinstance(state_dict_type, str):
            state_dict_type = StateDictType[state_dict_type.upper()]
    return _Settings(
        version=int(getattr(fsdp_plugin, "fsdp_version", 1) or 1),
        state_dict_type=state_dict_type,
        state_dict_config=model_config,
        optim_state_dict_config=optim_config,
        sync_module_states=bool(getattr(fsdp_plugin, "sync_module_states", False)),
    )


def _module(model: Any) -> torch.nn.Module:
    """The FSDP module of a prepared model (Fabric's wrapper peeled off), or ``model`` itself."""
    from lightning_accel.lightning_compat import fabric_forward_module

    return fabric_forward_module(model)


def _optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the shim's and Fabric's wrappers (each keeps it as ``.optimizer``)."""
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def _is_fsdp2(accelerator: Any, settings: _Settings) -> bool:
    found = getattr(accelerator, "is_fsdp2", None)
    return bool(found) if isinstance(found, bool) else settings.version == 2


def _on_cpu(module: torch.nn.Module) -> bool:
    first = next(iter(module.parameters()), None)
    return first is None or first.device.type == "cpu"


def _gather_rules(settings: _Settings, accelerator: Any, module: torch.nn.Module) -> None:
    """Accelerate's full-state-dict rule: offload to CPU and gather on rank 0 only with several processes.

    On CPU nothing is offloaded (the tensors are there already; FSDP1 fails when asked to).
    """
    from torch.distributed.fsdp import StateDictType

    if settings.state_dict_type != StateDictType.FULL_STATE_DICT:
        return
    several = accelerator.num_processes > 1
    settings.state_dict_config.offload_to_cpu = several and not _on_cpu(module)
    settings.state_dict_config.rank0_only = several


def _no_offload_on_cpu(settings: _Settings, module: torch.nn.Module) -> None:
    """On CPU, FSDP1 gathers a full optimizer state wrongly when asked to offload it to CPU: gather it in place."""
    config = settings.optim_state_dict_config
    if settings.version == 1 and _on_cpu(module) and getattr(config, "offload_to_cpu", False):
        config.offload_to_cpu = False


def _state_dict_context(settings: _Settings, module: torch.nn.Module) -> AbstractContextManager[Any]:
    if settings.version != 1:
        return nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.state_dict_type(
        module, settings.state_dict_type, settings.state_dict_config, settings.optim_state_dict_config
    )


def _options(settings: _Settings) -> Any:
    """FSDP2's ``StateDictOptions`` for the plugin (``None`` with FSDP1, which uses the state-dict context)."""
    if settings.version != 2:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import StateDictType

    return StateDictOptions(
        full_state_dict=settings.state_dict_type == StateDictType.FULL_STATE_DICT,
        cpu_offload=getattr(settings.state_dict_config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(settings.state_dict_config, "rank0_only", False),
    )


def _model_state(module: torch.nn.Module, adapter_only: bool, options: Any) -> dict[str, Any]:
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


def _set_model_state(module: torch.nn.Module, state: dict[str, Any], adapter_only: bool, options: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if adapter_only and is_peft_model(module):
        if options is not None and options.full_state_dict:
            return set_model_state_dict(module, state, options=replace(options, strict=False))
        from peft import set_peft_model_state_dict

        return set_peft_model_state_dict(module, state, adapter_name=module.active_adapter)
    if options is not None:
        return set_model_state_dict(module, state, options=options)
    return module.load_state_dict(state)


def _read_file(path: str, weights_only: bool) -> Any:
    """``torch.load`` of one checkpoint file, naming it if it cannot be read."""
    return read_checkpoint_file(path, lambda p: torch.load(p, weights_only=weights_only))


def _indexed(stem: str, index: int, suffix: str = ".bin") -> str:
    """``stem.bin`` for the first object, ``stem_{i}.bin`` after (Accelerate's names)."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def _dcp_dir(root: str | os.PathLike[str], name: str) -> Path:
    """``root/name``, or ``root`` itself when it already is that directory (Accelerate accepts both)."""
    return Path(root) if Path(root).name == name else Path(root) / name


@dataclass(frozen=True)
class _Place:
    """Where one model's or optimizer's state goes: Accelerate's names under ``root`` for ``stem`` and ``index``."""

    root: str | os.PathLike[str]
    stem: str  # pytorch_model_fsdp or optimizer
    index: int
    key: str  # the state's key in a torch.distributed.checkpoint directory
    rank: int
    use_dcp: bool


def _write(state: Any, settings: _Settings, place: _Place, saved: str) -> None:
    """Write ``state`` as Accelerate does: one gathered file from rank 0, a DCP directory, or a file per rank."""
    from torch.distributed.fsdp import StateDictType

    if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
        if place.rank == 0:
            path = os.path.join(place.root, _indexed(place.stem, place.index))
            torch.save(state, path)
            logger.info(f"{saved} {path}")
    elif place.use_dcp:
        import torch.distributed.checkpoint as dcp

        directory = os.path.join(place.root, f"{place.stem}_{place.index}")
        os.makedirs(directory, exist_ok=True)
        dcp.save(state_dict={place.key: state}, storage_writer=dcp.FileSystemWriter(directory))
        logger.info(f"{saved} {directory}")
    else:
        torch.save(state, os.path.join(place.root, f"{place.stem}_{place.index}_rank{place.rank}.bin"))


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Write an FSDP model's weights to ``output_dir`` as Accelerate does (every process calls it).

    Args:
        fsdp_plugin: The FSDP plugin (its ``fsdp_version`` and ``state_dict_type`` choose the format).
        accelerator: The accelerator (``num_processes``, ``process_index``).
        model: The FSDP-wrapped model (or the one ``Accelerator.prepare`` returned).
        output_dir: The folder (created if missing).
        model_index: The model's index, in the file names.
        adapter_only: For a PEFT model, the adapter's weights only.
        use_dcp: With ``SHARDED_STATE_DICT``, a ``torch.distributed.checkpoint`` directory; ``False`` writes one
            ``torch.save`` file per process (no collective; load it with ``use_dcp=False`` too).

    """
    from torch.distributed.fsdp import StateDictType

    settings, module = _settings(fsdp_plugin), _module(model)
    os.makedirs(output_dir, exist_ok=True)
    _gather_rules(settings, accelerator, module)
    options = _options(settings)
    rank = accelerator.process_index
    with _state_dict_context(settings, module):
        state = _model_state(module, adapter_only, options)
        if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            stem = FSDP_MODEL_NAME if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}"
            torch.save(state, os.path.join(output_dir, f"{stem}_rank{rank}.bin"))
        else:
            place = _Place(output_dir, FSDP_MODEL_NAME, model_index, "model", rank, use_dcp)
            _write(state, settings, place, "Model saved to")


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    """Load what :func:`save_fsdp_model` (or Accelerate's) wrote into an FSDP model; every process calls it.

    With ``FULL_STATE_DICT`` and FSDP1, only process 0 reads the file when the model's states are synced from it
    (``sync_module_states``), as in Accelerate; with FSDP2 process 0 reads it and broadcasts.

    Returns:
        What the model's ``load_state_dict`` returned (``None`` on the processes that load nothing).

    Raises:
        ValueError: Under FSDP1 with ``FULL_STATE_DICT`` on a process other than 0 when ``model`` is not FSDP-wrapped
            and ``sync_module_states`` is off (that process would keep its own weights).

    """
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    settings, module = _settings(fsdp_plugin), _module(model)
    rank, fsdp2 = accelerator.process_index, _is_fsdp2(accelerator, settings)
    accelerator.wait_for_everyone()
    _gather_rules(settings, accelerator, module)
    options = _options(settings)
    with _state_dict_context(settings, module):
        if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
            if type(module) is not FullyShardedDataParallel and rank != 0 and not fsdp2:
                if not settings.sync_module_states and settings.version == 1:
                    raise ValueError(
                        "Set the `sync_module_states` flag to `True` so that model states are synced across "
                        "processes when initializing FSDP object"
                    )
                return None
            path = os.path.join(input_dir, _indexed(FSDP_MODEL_NAME, model_index))
            load = not fsdp2 or accelerator.is_main_process  # FSDP2 broadcasts process 0's (broadcast_from_rank0)
            state = _read_file(path, weights_only=True) if load else {}
        elif settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            stem = FSDP_MODEL_NAME if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}"
            # FSDP1's local shards are ShardedTensors, which weights_only cannot rebuild (Accelerate fails here).
            state = _read_file(os.path.join(input_dir, f"{stem}_rank{rank}.bin"), weights_only=False)
        elif use_dcp:
            import torch.distributed.checkpoint as dcp

            directory = _dcp_dir(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
            holder = {"model": _model_state(module, adapter_only, options)}
            dcp.load(state_dict=holder, storage_reader=dcp.FileSystemReader(directory))
            state = holder["model"]
        else:
            name = f"{FSDP_MODEL_NAME}_{model_index}_rank{rank}.bin"
            state = _read_file(os.path.join(input_dir, name), weights_only=True)
        result = _set_model_state(module, state, adapter_only, options)
    accelerator.wait_for_everyone()
    return result


def _optimizer_state(settings: _Settings, module: torch.nn.Module, optimizer: Any, options: Any) -> Any:
    if settings.version == 2:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer, options=options)
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.optim_state_dict(module, optimizer)


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Write an FSDP optimizer's state (keyed by parameter name) to ``output_dir``; every process calls it.

    ``FULL_STATE_DICT``: ``optimizer.bin`` from process 0; otherwise ``optimizer_{i}/``
    (``torch.distributed.checkpoint``) or, with ``use_dcp=False``, ``optimizer_{i}_rank{r}.bin`` per process.
    """
    settings, module, optimizer = _settings(fsdp_plugin), _module(model), _optimizer(optimizer)
    os.makedirs(output_dir, exist_ok=True)
    _no_offload_on_cpu(settings, module)
    options = _options(settings)
    rank = accelerator.process_index
    with _state_dict_context(settings, module):
        state = _optimizer_state(settings, module, optimizer, options)
        place = _Place(output_dir, OPTIMIZER_NAME, optimizer_index, "optimizer", rank, use_dcp)
        _write(state, settings, place, "Optimizer state saved in")


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what :func:`save_fsdp_optimizer` (or Accelerate's) wrote into the optimizer; every process calls it.

    ``adapter_only`` is accepted for Accelerate's signature and unused, as there.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    del adapter_only
    settings, module, optimizer = _settings(fsdp_plugin), _module(model), _optimizer(optimizer)
    accelerator.wait_for_everyone()
    _no_offload_on_cpu(settings, module)
    options = _options(settings)
    rank = accelerator.process_index
    with _state_dict_context(settings, module):
        state: Any = None
        if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
            if rank == 0 or not getattr(settings.optim_state_dict_config, "rank0_only", False):
                path = os.path.join(input_dir, _indexed(OPTIMIZER_NAME, optimizer_index))
                state = _read_file(path, weights_only=True)
        elif use_dcp:
            import torch.distributed.checkpoint as dcp

            directory = _dcp_dir(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
            holder = {"optimizer": _optimizer_state(settings, module, optimizer, options)}
            dcp.load(state_dict=holder, storage_reader=dcp.FileSystemReader(directory))
            state = holder["optimizer"]
        else:
            name = f"{OPTIMIZER_NAME}_{optimizer_index}_rank{rank}.bin"
            state = _read_file(os.path.join(input_dir, name), weights_only=True)
        if settings.version == 1:
            flat = FullyShardedDataParallel.optim_state_dict_to_load(
                model=module, optim=optimizer, optim_state_dict=state
            )
            optimizer.load_state_dict(flat)
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(module, optimizer, state, options=options)
    accelerator.wait_for_everyone()
