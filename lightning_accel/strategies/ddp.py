"""Data-parallel strategies (``acc_multi_cpu``, ``acc_multi_gpu``, ``acc_multi_npu``, ..., ``acc_ddp``).

The behaviour lives in :class:`~lightning_accel.strategies.ddp_core.DDPFamily`; the two classes here adapt it to the
Trainer's and Fabric's ``DDPStrategy``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy as _TrainerDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_accel.config.devices import BACKEND_BY_TYPE
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import lightning_private_members
from lightning_accel.strategies.checkpoint_io import wait_for_background_save
from lightning_accel.strategies.ddp_core import DDPFamilyAdapter, DDPOptions
from lightning_accel.strategies.lightning_arguments import FabricPlugins, ParallelArguments, TrainerPlugins
from lightning_accel.strategies.precision_adoption import translating
from lightning_accel.strategies.protocol import ProcessGroupShards, ShimStrategyDefaults
from lightning_accel.strategies.registry import StrategyEntry


class TrainerDDPArgs(DDPOptions, ParallelArguments, TrainerPlugins, total=False):
    """The keyword arguments of :class:`AcceleratedDDPStrategy`."""


class FabricDDPArgs(DDPOptions, ParallelArguments, FabricPlugins, total=False):
    """The keyword arguments of :class:`FabricAcceleratedDDPStrategy`."""


@lightning_private_members("_configure_launcher", "_setup_model", "_register_ddp_hooks", "_get_process_group_backend")
class AcceleratedDDPStrategy(DDPFamilyAdapter, _TrainerDDPStrategy):
    """Trainer strategy for one process per device, gradients averaged by ``DistributedDataParallel``.

    Args:
        distributed_type: The Accelerate type (``MULTI_CPU``, ``MULTI_GPU``, ``MULTI_NPU``, ...). ``None`` derives it
            from the accelerator's devices.
        ddp_kwargs: Arguments for ``DistributedDataParallel`` and the communication hook to register.
        init_kwargs: Process-group options (collective backend, init method, timeout).
        dynamo_plugin: ``torch.compile`` settings applied to the model before it is wrapped.
        strategy_name: The name shown in messages (set by the registry).
        checkpoint_io: Lightning's checkpoint I/O; by default ``torch.save`` files, an unreadable one named in the
            error.
        start_method: How processes start: ``"popen"`` re-runs the script, the others use ``torch.multiprocessing``.
        **kwargs: The keyword settings above, and Lightning's ``accelerator``, ``parallel_devices``,
            ``cluster_environment`` and ``precision_plugin`` (the Trainer sets them when left out).

    Example:
        >>> import lightning as L
        >>> from lightning_accel.utils import DistributedDataParallelKwargs
        >>> trainer = L.Trainer(  # doctest: +SKIP
        ...     accelerator="cpu",
        ...     devices=2,
        ...     strategy=AcceleratedDDPStrategy(
        ...         "MULTI_CPU", ddp_kwargs=DistributedDataParallelKwargs(comm_hook="fp16")
        ...     ),
        ... )

    """

    def __init__(self, distributed_type: DistributedType | str | None = None, **kwargs: Unpack[TrainerDDPArgs]) -> None:
        super().__init__(**self._adopt_family(distributed_type, kwargs))

    precision_plugin = translating(_TrainerDDPStrategy.precision_plugin)

    @override
    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_process_group()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return self._family.wrap(model, self.determine_ddp_device_ids())

    @override
    def _register_ddp_hooks(self) -> None:
        """Hooks are registered by :meth:`_setup_model` on every device type (Lightning limits them to CUDA)."""

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, after a background save of this run has landed (every process waits for it)."""
        wait_for_background_save(self.checkpoint_io, lambda: self.barrier("load_checkpoint"))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


@lightning_private_members(
    "_configure_launcher",
    "_setup_distributed",
    "_set_world_ranks",
    "_determine_ddp_device_ids",
    "_get_process_group_backend",
)
class FabricAcceleratedDDPStrategy(ProcessGroupShards, DDPFamilyAdapter, _FabricDDPStrategy, ShimStrategyDefaults):
    """Fabric twin of :class:`AcceleratedDDPStrategy`.

    It takes the same arguments, with ``precision`` instead of ``precision_plugin``.
    """

    #: DDP-wrapped models are torch ``Joinable`` (``Accelerator.join_uneven_inputs``).
    joins_uneven_inputs = True

    def __init__(self, distributed_type: DistributedType | str | None = None, **kwargs: Unpack[FabricDDPArgs]) -> None:
        super().__init__(**self._adopt_family(distributed_type, kwargs))

    precision = translating(_FabricDDPStrategy.precision)

    @override
    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        self._init_process_group()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        return self._family.wrap(module, self._determine_ddp_device_ids())

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Lightning's load, after a background save of this run has landed (every process waits for it)."""
        wait_for_background_save(self.checkpoint_io, lambda: self.barrier("load_checkpoint"))
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def _entries() -> tuple[StrategyEntry, ...]:
    per_type = tuple(
        StrategyEntry(
            f"acc_{dt.value.lower()}",
            AcceleratedDDPStrategy,
            FabricAcceleratedDDPStrategy,
            f"DistributedDataParallel on {b.device_type} devices over {b.collective_backend} ({dt.value})",
            dt,
            {"distributed_type": dt},
        )
        for dt, b in BACKEND_BY_TYPE.items()
    )
    derived = StrategyEntry(
        "acc_ddp",
        AcceleratedDDPStrategy,
        FabricAcceleratedDDPStrategy,
        "DistributedDataParallel on the accelerator's devices (MULTI_CPU, MULTI_GPU, ...)",
    )
    return (*per_type, derived)


ENTRIES = _entries()
