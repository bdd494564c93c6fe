"""What ``acc_fsdp`` and ``acc_parallel`` add, the same way, to Lightning's Trainer and Fabric strategies.

Both shard with :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily` (FSDP2 shards the LightningModule in place),
so both redirect steps through the sharded model's ``forward``, free the parameters gathered by gradient-free passes,
and read and write checkpoints in ``acc_fsdp``'s formats: a ``torch.distributed.checkpoint`` directory with
``meta.pt``, or one full file written by process 0 through the strategy's ``CheckpointIO`` (Lightning's
model-parallel strategies have none: ``acc_parallel`` writes them with ``TorchCheckpointIO``). Each strategy names its
:class:`FSDPFamily` in ``_sharding`` and its name for messages in ``_checkpoint_label``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.lightning_compat import get_forward_redirection
from lightning_accel.strategies.checkpoint_io import (
    AsyncNamingCheckpointIO,
    resolve_weights_only,
    wait_for_background_save,
)
from lightning_accel.strategies.fsdp_core import FSDPFamily, checkpoint_value, load_target_error

if TYPE_CHECKING:
    from lightning.fabric.strategies import ParallelStrategy as _FabricBase
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ParallelStrategy as _TrainerBase
else:
    _FabricBase = _TrainerBase = object


def _background_io(checkpoint_io: CheckpointIO) -> AsyncNamingCheckpointIO | None:
    """The strategy's I/O where sharded saves run in the background; it waits for the pending save first.

    Raises:
        ValueError: If the I/O is Lightning's ``AsyncCheckpointIO``, which a sharded directory cannot go through.

    """
    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "Lightning's AsyncCheckpointIO cannot save a sharded checkpoint (SHARDED_STATE_DICT: a directory written"
            " by torch.distributed.checkpoint, not through a CheckpointIO), so the save would silently be"
            " synchronous. Use plugins=[lightning_accel.strategies.AsyncNamingCheckpointIO()], which saves it with"
            " torch's dcp.async_save."
        )
    if not isinstance(checkpoint_io, AsyncNamingCheckpointIO):
        return None
    checkpoint_io.wait()  # the previous save (a collective when it was sharded), its error raised
    return checkpoint_io


class _HasCheckpointIO(Protocol):
    @property
    def checkpoint_io(self) -> CheckpointIO: ...


class _Sharded:
    """What each strategy names: its :class:`FSDPFamily` and its name in messages."""

    _checkpoint_label: str

    @property
    def _sharding(self) -> FSDPFamily:
        raise NotImplementedError

    def _full_checkpoint_io(self: _HasCheckpointIO) -> CheckpointIO:
        """The writer of full checkpoint files: the strategy's ``CheckpointIO``."""
        return self.checkpoint_io


class ShardedTrainerAdapter(_Sharded, _TrainerBase):
    """Steps, resharding, state dicts and checkpoints of a sharding Trainer strategy (listed before its base)."""

    def _setup_optimizers_on_shards(self, trainer: Trainer) -> None:
        """When fitting, build the optimizers over the sharded parameters; set up the precision plugin in any stage."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_validation_end(self) -> None:
        reshard(self.model)

    @override
    def on_test_end(self) -> None:
        reshard(self.model)

    @override
    def on_predict_end(self) -> None:
        reshard(self.model)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    def _step(self, method: str, context: Callable[[], AbstractContextManager], *args: Any, **kwargs: Any) -> Any:
        """Run a step through the sharded model's ``forward`` so FSDP gathers parameters first.

        FSDP2 shards the LightningModule in place, so Lightning's own check (``model != lightning_module``) would
        skip the redirection and run the step on sharded parameters.
        """
        assert self.model is not None and self.lightning_module is not None
        with context():
            redirect = get_forward_redirection(self)
            return redirect(self.model, self.lightning_module, method, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._sharding.no_sync(self.model):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self._sharding.model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self._sharding.optimizer_state_dict(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write one full file through ``CheckpointIO`` (process 0), or a sharded directory.

        Raises:
            TypeError: If ``storage_options`` are given for a sharded checkpoint, which ``CheckpointIO`` does not
                write.
            ValueError: If the checkpoint I/O saves in the background and the checkpoint is sharded.

        """
        path = Path(self.broadcast(filepath))
        if self._sharding.full_state_dict:
            if self.is_global_zero:
                self._full_checkpoint_io().save_checkpoint(checkpoint, path, storage_options=storage_options)
        else:
            if storage_options is not None:
                raise TypeError(
                    f"{self._checkpoint_label} sharded checkpoints take no `storage_options`; drop them, or set"
                    " FullyShardedDataParallelPlugin(state_dict_type='FULL_STATE_DICT') to write through CheckpointIO."
                )
            background = _background_io(self._full_checkpoint_io())
            if background is None:
                self._sharding.save_trainer_checkpoint(checkpoint, path, self.is_global_zero)
            else:
                background.hold(self._sharding.start_trainer_save(checkpoint, path, self.is_global_zero))
        self.barrier(f"{self._checkpoint_label}.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        assert self.model is not None and self.lightning_module is not None
        wait_for_background_save(self._full_checkpoint_io(), lambda: self.barrier("load_checkpoint"))
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        safe = resolve_weights_only(weights_only)
        return self._sharding.load_trainer_checkpoint(path, self.model, optimizers, strict, weights_only=safe)


class ShardedFabricAdapter(_Sharded, _FabricBase):
    """State dicts and checkpoints of a sharding Fabric strategy (listed before its base)."""

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._sharding.model_state_dict(module)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write one full file through ``CheckpointIO`` (process 0), or a sharded directory with ``meta.pt``.

        Raises:
            TypeError: If ``storage_options`` or ``filter`` are given.
            ValueError: If ``state`` holds other than exactly one module, or the checkpoint I/O saves in the
                background and the checkpoint is sharded.

        """
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"{self._checkpoint_label} checkpoints take neither `storage_options` nor `filter`; drop them."
            )
        io = self._sharding
        background = None if io.full_state_dict else _background_io(self._full_checkpoint_io())
        path = Path(self.broadcast(path))
        module = self._single_module(state)
        converted = {
            key: io.model_state_dict(value)
            if isinstance(value, Module)
            else io.optimizer_state_dict(module, value)
            if isinstance(value, Optimizer)
            else checkpoint_value(value)
            for key, value in state.items()
        }
        if io.full_state_dict:
            if self.is_global_zero:
                self._full_checkpoint_io().save_checkpoint(converted, path)
        else:
            shards = [k for k, v in state.items() if isinstance(v, (Module, Optimizer))]
            if background is None:
                io.save_sharded(converted, shards, path, self.is_global_zero)
            else:
                background.hold(io.start_sharded_save(converted, shards, path, self.is_global_zero))
        self.barrier(f"{self._checkpoint_label}.save_checkpoint")

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load into live objects (``fabric.load``), or a full state-dict file into a module (``fabric.load_raw``).

        Weights-only unless ``weights_only=False`` (a trusted checkpoint; it warns naming each file).

        Raises:
            ValueError: If ``state`` is neither a module nor a dict holding exactly one module.

        """
        wait_for_background_save(self._full_checkpoint_io(), lambda: self.barrier("load_checkpoint"))
        if isinstance(state, Module):  # fabric.load_raw(path, model): a plain full state-dict file
            raw = Path(self.broadcast(path))
            self._sharding.load_raw_module(raw, state, strict=strict, weights_only=resolve_weights_only(weights_only))
            return {}
        if not isinstance(state, dict):
            raise ValueError(load_target_error(self._checkpoint_label, state))
        path = Path(self.broadcast(path))
        module = self._single_module(state)
        safe = resolve_weights_only(weights_only)
        return self._sharding.load_into(path, state, module, strict=strict, weights_only=safe)

    def _single_module(self, state: dict[str, Any]) -> Module:
        modules = [v for v in state.values() if isinstance(v, Module)]
        if len(modules) != 1:
            raise ValueError(
                f"{self._checkpoint_label} checkpoints hold exactly one sharded model, got {len(modules)} modules in"
                " the state; save each model to its own path."
            )
        return modules[0]


def reshard(module: Module | None) -> None:
    """Free the parameters FSDP2 units gathered for gradient-free forwards (no backward pass reshards them)."""
    from torch.distributed.fsdp import FSDPModule

    if module is None:
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
