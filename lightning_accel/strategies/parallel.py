"""``acc_parallel``: Accelerate's ``ParallelismConfig`` (dp_replicate x dp_shard x cp x tp) for the Trainer and Fabric.

Both classes extend Lightning's ``ModelParallelStrategy`` (FSDP2 + tensor parallelism on a ``DeviceMesh``, launching,
collectives) and replace its 2-D ``data_parallel x tensor_parallel`` mesh with Accelerate's N-D mesh. The behaviour
lives once in :class:`~lightning_accel.strategies.parallel_core.ParallelFamily`.

In a LightningModule, ``configure_model`` sees the mesh as ``self.device_mesh`` and may apply ``parallelize_module``
to ``self.device_mesh["tp"]``; afterwards the strategy shards the module with FSDP2 over ``dp_shard_cp`` (HSDP with
``dp_replicate``), unless ``configure_model`` already called ``fully_shard``. With Fabric, ``parallelize_fn(module,
mesh)`` plays the part of ``configure_model``. Both also take a ``tp_plan`` they apply themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallelStrategy
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.config import FullyShardedDataParallelPlugin, ParallelismConfig
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import (
    get_device_mesh,
    get_forward_redirection,
    get_parallelize_fn,
    lightning_private_members,
    set_device_mesh,
)
from lightning_accel.strategies.fsdp_core import checkpoint_value, load_target_error
from lightning_accel.strategies.parallel_core import ParallelFamily, ParallelFamilyAdapter, TensorParallelPlan
from lightning_accel.strategies.precision_bridge import bind_precision, translating
from lightning_accel.strategies.protocol import ProcessGroupShards, ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ParallelizeFn = Callable[[Module, "DeviceMesh"], Module]


@lightning_private_members("_configure_launcher", "_setup_distributed")
class AcceleratedParallelStrategy(ParallelFamilyAdapter, _TrainerModelParallelStrategy):
    """Trainer strategy for N-D parallelism from a :class:`~lightning_accel.config.ParallelismConfig`.

    Args:
        parallelism_config: The sizes of ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``; their product must be the
            number of processes. ``None`` replicates over all processes.
        fsdp_plugin: FSDP2 settings for the shard dimensions; its ``state_dict_type`` chooses sharded
            (``torch.distributed.checkpoint`` directory, the default) or full (one file) checkpoints.
        tp_plan: A ``parallelize_module`` plan for the ``tp`` dimension, applied after ``configure_model``.
        strategy_name: The name shown in messages (set by the registry).
        process_group_backend: Collective backend; ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.

    Example:
        >>> import lightning as L
        >>> from lightning_accel.utils import ParallelismConfig
        >>> strategy = AcceleratedParallelStrategy(ParallelismConfig(dp_shard_size=2, tp_size=2))
        >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy)  # doctest: +SKIP

    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        *,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        tp_plan: TensorParallelPlan | None = None,
        strategy_name: str = "acc_parallel",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self._parallel = ParallelFamily(parallelism_config, fsdp_plugin, tp_plan)
        self.strategy_name = strategy_name
        super().__init__(
            save_distributed_checkpoint=not self._parallel.checkpoints.full_state_dict,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._parallelized: Module | None = None

    precision_plugin = translating(_TrainerModelParallelStrategy.precision_plugin)

    @property
    def distributed_type(self) -> DistributedType | None:
        """``FSDP`` when anything is sharded or split, else the multi-device (DDP) type of the devices."""
        return self._parallel.distributed_type(self.parallel_devices[0].type if self.parallel_devices else None)

    @override
    def _configure_launcher(self) -> None:
        assert self.parallel_devices is not None
        self._parallel.check_processes(self.num_nodes * self.num_processes, self.parallel_devices[0].type)
        bind_precision(self.precision_plugin, self.parallel_devices)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        """Start the process group, build Accelerate's mesh and hand it to the LightningModule's ``device_mesh``."""
        self._setup_distributed()
        mesh = self._parallel.build_mesh(self.root_device.type)
        set_device_mesh(self, mesh)
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, mesh)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._parallel.sampler_kwargs()

    @override
    def setup(self, trainer: Trainer) -> None:
        """Parallelize the model ``configure_model`` built (once; later entry points reuse it), then the optimizers."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:
            self.model = self.precision_plugin.convert_module(self.model)
            self.model = self._parallel.parallelize(self.model, self.root_device, self.precision_plugin)
            self.model_to_device()
            self._parallelized = self.model
        _reshard(self.model)
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_validation_end(self) -> None:
        _reshard(self.model)

    @override
    def on_test_end(self) -> None:
        _reshard(self.model)

    @override
    def on_predict_end(self) -> None:
        _reshard(self.model)

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
        """Run a step through the model's ``forward`` so an FSDP2 root on the LightningModule gathers first."""
        assert self.model is not None and self.lightning_module is not None
        with context():
            redirect = get_forward_redirection(self)
            return redirect(self.model, self.lightning_module, method, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with self._parallel.checkpoints.no_sync(self.model):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self._parallel.checkpoints.model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self._parallel.checkpoints.optimizer_state_dict(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write ``acc_fsdp``'s formats: a sharded ``torch.distributed.checkpoint`` directory, or one full file."""
        if storage_options is not None:
            raise TypeError("acc_parallel checkpoints take no `storage_options`; drop them.")
        path = Path(self.broadcast(filepath))
        if self._parallel.checkpoints.full_state_dict:
            if self.is_global_zero:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(checkpoint, path)
        else:
            self._parallel.checkpoints.save_trainer_checkpoint(checkpoint, path, self.is_global_zero)
        self.barrier("acc_parallel.save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        return self._parallel.checkpoints.load_trainer_checkpoint(path, self.model, optimizers, strict)


@lightning_private_members("_configure_launcher", "_setup_distributed")
class FabricAcceleratedParallelStrategy(
    ProcessGroupShards, ParallelFamilyAdapter, _FabricModelParallelStrategy, ShimStrategyDefaults
):
    """Fabric twin of :class:`AcceleratedParallelStrategy`.

    Args:
        parallelism_config: As for the Trainer strategy.
        parallelize_fn: ``fn(module, device_mesh) -> module`` applying tensor parallelism (and, if it wants,
            ``fully_shard``) before the strategy shards what is left; ``None`` leaves it to ``tp_plan``.
        fsdp_plugin: As for the Trainer strategy.
        tp_plan: As for the Trainer strategy (applied after ``parallelize_fn``).
        strategy_name: The name shown in messages (set by the registry).
        process_group_backend: Collective backend; ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: Collective timeout.

    ``fabric.setup(model, optimizer)`` takes an optimizer built from the plain model and points it at the
    parallelized parameters (Accelerate's one-call ``prepare``); ``setup_module`` then ``setup_optimizers`` works too.

    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        *,
        parallelize_fn: ParallelizeFn | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        tp_plan: TensorParallelPlan | None = None,
        strategy_name: str = "acc_parallel",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"`parallelize_fn` must be callable(module, device_mesh), got {parallelize_fn!r}.")
        self._parallel = ParallelFamily(parallelism_config, fsdp_plugin, tp_plan)
        self.strategy_name = strategy_name
        super().__init__(
            parallelize_fn=parallelize_fn or _unchanged,
            save_distributed_checkpoint=not self._parallel.checkpoints.full_state_dict,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    precision = translating(_FabricModelParallelStrategy.precision)

    @property
    def distributed_type(self) -> DistributedType | None:
        """``FSDP`` when anything is sharded or split, else the multi-device (DDP) type of the devices."""
        return self._parallel.distributed_type(self.parallel_devices[0].type if self.parallel_devices else None)

    @override
    def _configure_launcher(self) -> None:
        assert self.parallel_devices is not None
        self._parallel.check_processes(self.num_nodes * self.num_processes, self.parallel_devices[0].type)
        bind_precision(self.precision, self.parallel_devices)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        """Start the process group and build Accelerate's mesh (``device_mesh`` and ``torch_device_mesh``)."""
        self._setup_distributed()
        set_device_mesh(self, self._parallel.build_mesh(self.root_device.type))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._parallel.sampler_kwargs()

    @override
    def setup_module(self, module: Module) -> Module:
        return self._parallel.parallelize(self._user_parallelized(module), self.root_device, self.precision)

    def mesh_rank(self, dimension: str) -> int:
        """The coordinate of this process along the mesh's ``dimension`` (0 where the mesh lacks it)."""
        return self._parallel.rank(dimension)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """Parallelize ``module`` and point ``optimizers``, built from its plain parameters, at the new ones.

        Raises:
            ValueError: As :meth:`~lightning_accel.strategies.parallel_core.ParallelFamily.parallelize`, or if an
                optimizer holds a tensor that is not a parameter of ``module``.

        """
        from lightning_accel.strategies.fsdp_optimizers import optimizer_parameter_names, repoint_optimizers

        names = optimizer_parameter_names(module, optimizers)
        parallel = self.setup_module(module)
        repoint_optimizers(parallel, optimizers, names)
        return parallel, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def _user_parallelized(self, module: Module) -> Module:
        if self.device_mesh is None:
            return module
        result = get_parallelize_fn(self)(module, self.device_mesh)
        if not isinstance(result, Module):
            raise TypeError(f"`parallelize_fn` must return the nn.Module, got {type(result).__name__}.")
        return result

    @property
    @override
    def device_mesh(self) -> DeviceMesh:  # None with a single process
        mesh: DeviceMesh = get_device_mesh(self)
        return mesh

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._parallel.checkpoints.model_state_dict(module)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``acc_fsdp``'s formats: a sharded directory with ``meta.pt``, or one full file from rank 0."""
        if storage_options is not None or filter is not None:
            raise ValueError("acc_parallel checkpoints take neither `storage_options` nor `filter`; drop them.")
        path = Path(self.broadcast(path))
        io = self._parallel.checkpoints
        module = _single_module(state)
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
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(converted, path)
        else:
            shards = [k for k, v in state.items() if isinstance(v, (Module, Optimizer))]
            io.save_sharded(converted, shards, path, self.is_global_zero)
        self.barrier("acc_parallel.save_checkpoint")

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if isinstance(state, Module):  # fabric.load_raw(path, model): a plain full state-dict file
            self._parallel.checkpoints.load_raw_module(Path(self.broadcast(path)), state, strict=strict)
            return {}
        if not isinstance(state, dict):
            raise ValueError(load_target_error("acc_parallel", state))
        path = Path(self.broadcast(path))
        return self._parallel.checkpoints.load_into(path, state, _single_module(state), strict=strict)


def _unchanged(module: Module, mesh: Any) -> Module:
    return module


def _reshard(module: Module | None) -> None:
    """Free the parameters FSDP2 units gathered for gradient-free forwards (no backward reshards them)."""
    from torch.distributed.fsdp import FSDPModule

    if module is None:
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _single_module(state: dict[str, Any]) -> Module:
    modules = [v for v in state.values() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"acc_parallel checkpoints hold exactly one parallelized model, got {len(modules)} modules in the state;"
            " save each model to its own path."
        )
    return modules[0]


ENTRIES = (
    StrategyEntry(
        "acc_parallel",
        AcceleratedParallelStrategy,
        FabricAcceleratedParallelStrategy,
        "N-D parallelism from Accelerate's ParallelismConfig (dp_replicate x dp_shard/FSDP2 x cp x tp on a DeviceMesh)",
    ),
)
