"""The behaviour of ``acc_fsdp``, written once for the Trainer and Fabric strategies.

It wraps a module with FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``) from a
:class:`FullyShardedDataParallelPlugin`, controls gradient sync for accumulation, and moves state dicts and checkpoints
in and out of the sharded model through ``torch.distributed.checkpoint``, which speaks both versions. Everything runs on
CPU (gloo) as well as on GPUs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.checkpoint.background import BackgroundSave, background_group, host_copy
from lightning_accel.checkpoint.folders import move_into_place
from lightning_accel.checkpoint.fsdp_layout import shard_failure
from lightning_accel.checkpoint.fsdp_policy import check_state_dict_configs, state_dict_options
from lightning_accel.config import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.strategies.checkpoint_io import writing_path
from lightning_accel.strategies.compile import apply_dynamo
from lightning_accel.strategies.ddp_core import ProcessGroupOptions
from lightning_accel.strategies.fsdp_optimizers import optimizer_parameter_names, repoint_optimizers
from lightning_accel.strategies.lightning_arguments import StartMethod
from lightning_accel.strategies.precision_adoption import strategy_precision
from lightning_accel.utils.fsdp_utils import apply_ac, apply_fsdp2
from lightning_accel.utils.modeling.checkpoint import (
    METADATA_FILENAME,
    contained_reader,
    is_sharded_checkpoint,
    read_checkpoint_file,
    weights_only_planner,
)
from lightning_accel.utils.other import load, torch_save

_MODEL_KEY = "state_dict"
_OPTIMIZER_PREFIX = "optimizer_"


class FSDPFamily:
    """Wrapping, gradient-sync control and state-dict handling for FSDP1 and FSDP2.

    Args:
        plugin: Accelerate's FSDP settings; ``None`` means the defaults (FSDP2, full sharding, sharded checkpoints).
        dynamo_plugin: ``torch.compile`` settings applied to the model before it is sharded.

    """

    def __init__(
        self, plugin: FullyShardedDataParallelPlugin | None, dynamo_plugin: TorchDynamoPlugin | None = None
    ) -> None:
        if plugin is not None and not isinstance(plugin, FullyShardedDataParallelPlugin):
            raise TypeError(f"`fsdp_plugin` must be a FullyShardedDataParallelPlugin, got {type(plugin).__name__}.")
        self.plugin = plugin or FullyShardedDataParallelPlugin()
        self.dynamo_plugin = dynamo_plugin
        configs = {
            "state_dict_config": self.plugin.state_dict_config,
            "optim_state_dict_config": self.plugin.optim_state_dict_config,
        }
        check_state_dict_configs(str(self.plugin.state_dict_type), configs)

    @property
    def version(self) -> int:
        """1 for ``FullyShardedDataParallel``, 2 for ``fully_shard``."""
        return int(self.plugin.fsdp_version)

    @property
    def full_state_dict(self) -> bool:
        """Whether checkpoints hold the full (gathered) state rather than one shard per process."""
        return self.plugin.state_dict_type == "FULL_STATE_DICT"

    def wrap(
        self, module: Module, device: torch.device, world_size: int, precision: Any = None, mesh: Any = None
    ) -> Module:
        """Shard ``module`` across the default process group (or FSDP2's ``mesh``); returns the module to train.

        The module is compiled first, as the dynamo plugin says. Without a ``mixed_precision_policy`` in the plugin,
        a mixed-precision ``precision`` plugin (bf16/fp16 autocast) also sets FSDP's parameter, reduction and buffer
        dtypes to its compute dtype, as Accelerate does.

        Raises:
            ValueError: If ``cpu_offload`` is requested while training on CPU, where there is nothing to offload.

        """
        module = apply_dynamo(module, self.dynamo_plugin)
        if device.type == "cpu" and self._offloads():
            raise ValueError(
                "FullyShardedDataParallelPlugin(cpu_offload=...) moves parameters from an accelerator to CPU memory,"
                " but this run already trains on CPU. Drop cpu_offload, or train on a GPU."
            )
        if self.plugin.activation_checkpointing:
            apply_ac(module, self.plugin)
        mixed_precision = self._mixed_precision(precision)
        if self.version == 1:
            return self._wrap_fsdp1(module, device, mixed_precision)
        return self._wrap_fsdp2(module, device, world_size, mixed_precision, mesh)

    def wrap_with_optimizers(
        self,
        module: Module,
        optimizers: Sequence[Optimizer],
        device: torch.device,
        world_size: int,
        precision: Any = None,
    ) -> Module:
        """:meth:`wrap` ``module`` and point ``optimizers``, built from its unsharded parameters, at the sharded ones.

        This is Accelerate's one-call ``prepare(model, optimizer)``. Each param group keeps its settings and gets the
        sharded parameters of the names it held (see :mod:`~lightning_accel.strategies.fsdp_optimizers`).

        Raises:
            ValueError: If an optimizer has already stepped, holds a tensor that is not a parameter of ``module``, or
                (FSDP1 with ``use_orig_params=False``) splits the parameters of one flat parameter between param
                groups or optimizers.

        """
        names = optimizer_parameter_names(module, optimizers)
        sharded = self.wrap(module, device, world_size, precision)
        repoint_optimizers(sharded, optimizers, names)
        return sharded

    def adopt_precision(self, precision: Any) -> None:
        """Tell an fp8 plugin, before it converts the model, which FSDP version will shard it.

        Under FSDP2 torchao's float8 Linears then all-gather their weights in float8 (Accelerate's default,
        ``AORecipeKwargs.enable_fsdp_float8_all_gather``); FSDP1 shards ordinary float8 Linears.
        """
        from lightning_accel.precision import FP8Precision

        if isinstance(precision, FP8Precision):
            precision.shard_with_fsdp(self.version)

    def refresh_float8_scales_after_steps(self, optimizer: Optimizer, modules: Iterable[Module]) -> None:
        """After each step of ``optimizer``, recompute the float8 scales of the sharded modules it trains.

        Only modules whose weights are all-gathered in float8 (FSDP2 with fp8) have such scales; Accelerate registers
        the same hook (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) in ``prepare``.
        """
        from lightning_accel.precision.fp8 import float8_all_gather_modules

        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in modules:
            if float8_all_gather_modules(module) and any(id(p) in trained for p in module.parameters()):
                optimizer.register_step_post_hook(functools.partial(_refresh_after_step, module))

    @contextmanager
    def no_sync(self, module: Module, enabled: bool = True) -> Generator[None, None, None]:
        """Skip gradient reduction for the backward passes inside the block (gradient accumulation)."""
        if not enabled:
            yield
            return
        if self.version == 1:
            with module.no_sync():  # type: ignore[operator]  # FullyShardedDataParallel.no_sync
                yield
            return
        fsdp2_modules = [m for m in module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for m in fsdp2_modules:
            m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        try:
            yield
        finally:
            for m in fsdp2_modules:
                m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]

    def model_state_dict(self, model: Module, full: bool | None = None) -> dict[str, Any]:
        """The model's state dict: gathered on every process if ``full``, else this process's shards."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=self._options(model, full, self.plugin.state_dict_config))

    def optimizer_state_dict(self, model: Module, optimizer: Optimizer, full: bool | None = None) -> dict[str, Any]:
        """The optimizer's state dict, keyed by parameter names (full or sharded like the model's)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        config = self.plugin.optim_state_dict_config
        return get_optimizer_state_dict(model, optimizer, options=self._options(model, full, config))

    def save_sharded(self, state: dict[str, Any], shard_keys: Iterable[str], path: Path, is_global_zero: bool) -> None:
        """Write a sharded checkpoint directory: the ``shard_keys`` entries as shards, ``meta.pt`` with the rest."""
        import torch.distributed.checkpoint as dcp

        keys = set(shard_keys)
        path.mkdir(parents=True, exist_ok=True)
        dcp.save({k: v for k, v in state.items() if k in keys}, checkpoint_id=path)
        if is_global_zero:
            torch_save({k: v for k, v in state.items() if k not in keys}, path / METADATA_FILENAME)

    def start_sharded_save(
        self, state: dict[str, Any], shard_keys: Iterable[str], path: Path, is_global_zero: bool
    ) -> BackgroundSave:
        """Start writing :meth:`save_sharded`'s directory in the background; every process must call it.

        torch's ``dcp.async_save`` copies the shards on the caller's thread and writes them into the hidden sibling
        ``.<name>.writing`` (its collectives on a process group of their own, so that they never interleave with
        training's); process 0 writes ``meta.pt`` there, from a host copy made now. The directory gets its name in
        :meth:`BackgroundSave.finish` (a collective), once every process has written its shards.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        keys = set(shard_keys)
        writing = writing_path(path)
        writing.mkdir(parents=True, exist_ok=True)
        shards = {k: v for k, v in state.items() if k in keys}
        written = dcp.async_save(shards, checkpoint_id=writing, process_group=background_group())
        assert isinstance(written, Future)  # the default stager's answer (AsyncSaveResponse comes with another)
        meta = host_copy({k: v for k, v in state.items() if k not in keys}) if is_global_zero else None

        def write() -> None:
            try:
                written.result()
            except CheckpointException as error:  # a BaseException
                raise shard_failure(error, writing, torch.distributed.get_rank()) from error
            if meta is not None:
                torch_save(meta, writing / METADATA_FILENAME)

        def publish() -> None:
            if is_global_zero:
                move_into_place(writing, path)

        return BackgroundSave(write, publish, together=True, what=str(path), daemon=False)

    def start_trainer_save(self, checkpoint: dict[str, Any], path: Path, is_global_zero: bool) -> BackgroundSave:
        """:meth:`save_trainer_checkpoint` in the background (see :meth:`start_sharded_save`)."""
        state = _optimizer_list_to_keys(dict(checkpoint))
        shard_keys = [k for k in state if k == _MODEL_KEY or k.startswith(_OPTIMIZER_PREFIX)]
        return self.start_sharded_save(state, shard_keys, path, is_global_zero)

    def load_into(
        self, path: Path, state: dict[str, Any], model: Module, strict: bool = True, *, weights_only: bool = True
    ) -> dict[str, Any]:
        """Load a checkpoint file or sharded directory into the live objects of ``state``.

        Modules and optimizers in ``state`` are loaded in place (``model`` is the sharded module the optimizers
        belong to); other entries of ``state`` are replaced by the checkpoint's values. Every file is read
        weights-only unless ``weights_only=False`` (a trusted checkpoint; it warns naming the file).

        Returns:
            What the checkpoint holds beyond the keys of ``state``.

        Raises:
            FileNotFoundError: If ``path`` is neither a checkpoint file nor a sharded checkpoint directory.
            KeyError: If ``strict`` and the checkpoint lacks one of the keys of ``state``.
            UnsafeCheckpointError: (a ``ValueError``) If a weights-only load refuses a file, naming it.

        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from lightning_accel.precision.fp8 import refresh_float8_scales

        live = {k: v for k, v in state.items() if isinstance(v, (Module, Optimizer))}
        if is_sharded_checkpoint(path):
            checkpoint = self._read_sharded(path, live, model, weights_only)
            options = StateDictOptions(strict=strict)
        elif path.is_file():
            read = lambda p: load(p, map_location="cpu", weights_only=weights_only)  # noqa: E731
            checkpoint = _optimizer_list_to_keys(read_checkpoint_file(path, read))
            options = StateDictOptions(full_state_dict=True, strict=strict)
        else:
            raise FileNotFoundError(
                f"No checkpoint at {str(path)!r}: expected a checkpoint file or a sharded checkpoint directory"
                f" (with {METADATA_FILENAME})."
            )
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"The checkpoint at {str(path)!r} has no {missing}; it holds {sorted(checkpoint)}.")
        for key, value in state.items():
            if key not in checkpoint:
                continue
            if isinstance(value, Module):
                set_model_state_dict(value, checkpoint.pop(key), options=options)
                refresh_float8_scales(value)  # scales precomputed for the weights before the load are stale
            elif isinstance(value, Optimizer):
                set_optimizer_state_dict(model, value, checkpoint.pop(key), options=options)
            elif isinstance(value, _Stateful):  # a stateful data loader, a scheduler: restored in place
                value.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    def load_raw_module(self, path: Path, module: Module, strict: bool = True, *, weights_only: bool = True) -> None:
        """Load a plain full state-dict file (``torch.save(model.state_dict())``) into the sharded ``module``.

        This is ``fabric.load_raw(path, model)``: every process reads the file (weights-only unless
        ``weights_only=False``) and keeps its own shards.

        Raises:
            ValueError: If ``path`` is a sharded checkpoint directory rather than one state-dict file.
            FileNotFoundError: If there is nothing at ``path``.

        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from lightning_accel.precision.fp8 import refresh_float8_scales

        if is_sharded_checkpoint(path) or path.is_dir():
            raise ValueError(
                f"`load_raw` reads one file holding a full state dict, but {str(path)!r} is a directory; load a sharded"
                " checkpoint with `fabric.load(path, {'model': model, ...})`."
            )
        if not path.is_file():
            raise FileNotFoundError(f"No state-dict file at {str(path)!r}.")
        read = lambda p: load(p, map_location="cpu", mmap=True, weights_only=weights_only)  # noqa: E731
        state_dict = read_checkpoint_file(path, read)
        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))
        refresh_float8_scales(module)

    def save_trainer_checkpoint(self, checkpoint: dict[str, Any], path: Path, is_global_zero: bool) -> None:
        """Write a Trainer checkpoint (``state_dict`` and ``optimizer_states`` become shards)."""
        state = _optimizer_list_to_keys(dict(checkpoint))
        shard_keys = [k for k in state if k == _MODEL_KEY or k.startswith(_OPTIMIZER_PREFIX)]
        self.save_sharded(state, shard_keys, path, is_global_zero)

    def load_trainer_checkpoint(
        self,
        path: Path,
        model: Module,
        optimizers: Iterable[Optimizer],
        strict: bool = True,
        *,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """Load a Trainer checkpoint into the sharded model and its optimizers; returns the loop and callback state."""
        state: dict[str, Any] = {_MODEL_KEY: model}
        state.update({f"{_OPTIMIZER_PREFIX}{i}": optimizer for i, optimizer in enumerate(optimizers)})
        return self.load_into(path, state, model, strict=strict, weights_only=weights_only)

    def _read_sharded(
        self, path: Path, live: dict[str, Module | Optimizer], model: Module, weights_only: bool
    ) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        shards = {
            key: self.model_state_dict(value, full=False)
            if isinstance(value, Module)
            else self.optimizer_state_dict(model, value, full=False)
            for key, value in live.items()
        }
        planner = weights_only_planner(dcp.DefaultLoadPlanner(), path, weights_only)
        reader = contained_reader(path)
        read_checkpoint_file(path, lambda _: dcp.load(shards, storage_reader=reader, planner=planner))
        read = lambda p: load(p, map_location="cpu", weights_only=weights_only)  # noqa: E731
        metadata = read_checkpoint_file(path / METADATA_FILENAME, read)
        return {**metadata, **shards}

    def _options(self, model: Module, full: bool | None, config: Any = None) -> Any:
        """The policy's options; the plugin's ``config`` applies to the state-dict type it was set for."""
        gathered = self.full_state_dict if full is None else full
        return state_dict_options(model, gathered, config if gathered == self.full_state_dict else None)

    def _offloads(self) -> bool:
        offload = self.plugin.cpu_offload
        if isinstance(offload, bool):
            return offload
        from torch.distributed.fsdp import CPUOffloadPolicy

        return isinstance(offload, CPUOffloadPolicy) or bool(getattr(offload, "offload_params", False))

    def _mixed_precision(self, precision: Any) -> Any:
        """The torch mixed-precision object: the plugin's own, else one derived from the precision plugin."""
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        if self.plugin.mixed_precision_policy is not None:
            return self.plugin.torch_mixed_precision()
        dtype = getattr(precision, "compute_dtype", torch.float32)
        if getattr(precision, "mode", "true") != "mixed" or dtype == torch.float32:
            return None
        if self.version == 1:
            return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    def _wrap_fsdp1(self, module: Module, device: torch.device, mixed_precision: Any) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        plugin = self.plugin
        sync_module_states = bool(plugin.sync_module_states)
        if sync_module_states and device.type == "cpu":
            # torch's FSDP1 broadcasts only GPU tensors; on CPU, broadcast from rank 0 over gloo before wrapping.
            _broadcast_module_states(module)
            sync_module_states = False
        return FullyShardedDataParallel(
            module,
            device_id=device,
            sharding_strategy=plugin.torch_sharding_strategy(),
            cpu_offload=plugin.torch_cpu_offload(),  # type: ignore[arg-type]  # a CPUOffload for fsdp_version=1
            mixed_precision=mixed_precision,
            auto_wrap_policy=plugin.build_auto_wrap_policy(module),
            backward_prefetch=plugin.torch_backward_prefetch(),
            forward_prefetch=bool(plugin.forward_prefetch),
            limit_all_gathers=plugin.limit_all_gathers,
            use_orig_params=bool(plugin.use_orig_params),
            sync_module_states=sync_module_states,
            param_init_fn=plugin.param_init_fn,
            ignored_modules=self._ignored_modules(module),
        )

    def _wrap_fsdp2(
        self, module: Module, device: torch.device, world_size: int, mixed_precision: Any, mesh: Any = None
    ) -> Module:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size,)) if mesh is None else mesh
        return apply_fsdp2(module, self.plugin, mesh=mesh, mp_policy=mixed_precision)

    def _ignored_modules(self, root: Module) -> list[Module] | None:
        ignored = self.plugin.ignored_modules
        if ignored is None:
            return None
        if isinstance(ignored, str):
            pattern = re.compile(ignored)
            return [m for name, m in root.named_modules() if name and pattern.fullmatch(name)]
        return list(ignored)


class FSDPOptions(ProcessGroupOptions, total=False):
    """``acc_fsdp``'s settings besides ``fsdp_plugin`` (documented on the strategies in :mod:`.fsdp`)."""

    dynamo_plugin: TorchDynamoPlugin | None
    start_method: StartMethod


class FSDPFamilyAdapter:
    """What the Trainer and Fabric ``acc_fsdp`` strategies share, read from their ``_fsdp`` (listed first in bases)."""

    _fsdp: FSDPFamily
    _checkpoint_label = "acc_fsdp"

    def _adopt_fsdp(
        self, fsdp_plugin: FullyShardedDataParallelPlugin | None, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Build the strategy's :class:`FSDPFamily`; the arguments for the DDP strategy it extends."""
        self._fsdp = FSDPFamily(fsdp_plugin, options.get("dynamo_plugin"))
        return {"strategy_name": "acc_fsdp", **{key: value for key, value in options.items() if key != "dynamo_plugin"}}

    @property
    def _sharding(self) -> FSDPFamily:
        return self._fsdp

    @property
    def distributed_type(self) -> DistributedType:
        """Always ``FSDP``."""
        return DistributedType.FSDP

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin:
        """The FSDP settings in use."""
        return self._fsdp.plugin

    def _configure_launcher(self) -> None:
        """The DDP family's launch checks, then FSDP takes its mixed precision from the strategy's plugin."""
        super()._configure_launcher()  # type: ignore[misc]  # the DDP twin's, after this class in the MRO
        self._fsdp.adopt_precision(strategy_precision(self))


def checkpoint_value(value: Any) -> Any:
    """What a checkpoint stores for a state entry other than a module or an optimizer.

    A stateful object (a resumable data loader, a scheduler, anything with ``state_dict``/``load_state_dict``) is
    stored as its ``state_dict()``, and :meth:`FSDPFamily.load_into` hands that back to its ``load_state_dict``, as
    Lightning's strategies do; any other value is stored as it is.
    """
    return value.state_dict() if isinstance(value, _Stateful) else value


def load_target_error(strategy: str, state: Any) -> str:
    """The message for ``fabric.load``/``load_raw`` into something other than a module or a state dict."""
    if isinstance(state, Optimizer):
        return (
            f"{strategy} loads an optimizer only together with its sharded model (its state is keyed by the model's"
            f" parameter names): `fabric.load(path, {{'model': model, 'optimizer': optimizer, ...}})`; got"
            f" {type(state).__name__}."
        )
    return (
        f"{strategy} loads a checkpoint into live objects, `fabric.load(path, {{'model': model, ...}})`, or a plain"
        f" state-dict file into a model, `fabric.load_raw(path, model)`; got {state!r}."
    )


def _refresh_after_step(module: Module, *_: Any) -> None:
    from lightning_accel.precision.fp8 import refresh_float8_scales

    refresh_float8_scales(module)


def _broadcast_module_states(module: Module) -> None:
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(module, _get_default_group(), 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())


def _optimizer_list_to_keys(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Turn the Trainer's ``optimizer_states`` list into ``optimizer_0``, ``optimizer_1``, ... entries."""
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        checkpoint[f"{_OPTIMIZER_PREFIX}{index}"] = optimizer_state
    return checkpoint
