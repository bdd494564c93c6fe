"""What ``lightning_accel.Accelerator`` asks of the Fabric strategy it runs on, declared once.

The shim never branches on a strategy's class: every ``acc_*`` Fabric strategy answers the questions of
:class:`ShimStrategy` (most with the do-nothing answers of :class:`ShimStrategyDefaults`, listed last among its bases so
that Lightning's and the family adapters' members take precedence), and the DeepSpeed, FSDP and ``acc_parallel``
strategies give their own answers where their engine differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from typing_extensions import override

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_accel.checkpoint.engines import EngineCheckpoint
    from lightning_accel.config import FullyShardedDataParallelPlugin, ParallelismConfig
    from lightning_accel.enums import DistributedType

__all__ = [
    "ContextBackwardSync",
    "PipelineStep",
    "ShimStrategy",
    "ShimStrategyDefaults",
    "StepEngine",
    "as_shim_strategy",
]


class StepEngine(Protocol):
    """A training engine that steps inside ``Accelerator.backward`` (DeepSpeed's ``DeepSpeedEngine``)."""

    optimizer: Any
    lr_scheduler: Any

    def step(self) -> None:
        """Clip, step the optimizer (and the config's scheduler) and zero the gradients at a boundary."""

    def gradient_clipping(self) -> float:
        """The norm the engine clips to."""

    def get_global_grad_norm(self) -> Any:
        """The gradient norm of the last step (``None`` before the first)."""

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the coming backward pass ends an accumulation."""


class PipelineStep(Protocol):
    """A pipeline-parallel training step run by the strategy (megatron-core's schedules at ``pp_degree > 1``)."""

    def pipeline_step(
        self,
        module: Module,
        batch: Sequence[torch.Tensor],
        forward: Callable[[Module, Sequence[torch.Tensor]], torch.Tensor],
        loss: Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor],
        *,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """Forward (and, unless ``forward_only``, backward) ``batch`` in micro-batches; the reported loss."""


class ShimStrategy(Protocol):
    """The members of a Fabric strategy that ``lightning_accel.Accelerator`` reads, with their do-nothing answers.

    The method bodies are the answers of a strategy without an engine of its own; :class:`ShimStrategyDefaults`
    inherits them.

    Attributes:
        engine_steps_in_backward: Whether the engine accumulates and steps inside ``backward`` (DeepSpeed): the
            prepared optimizer's ``step`` then does nothing and ``clip_grad_norm_`` reports the engine's norm.
        marks_step_boundary: Whether skipping gradient synchronisation (``no_backward_sync``) is also the engine's
            signal that the optimizer does not step yet, so it must be entered even with ``sync_each_batch``.
        joins_uneven_inputs: Whether the models it wraps are torch ``Joinable`` (DDP), for ``join_uneven_inputs``.

    """

    engine_steps_in_backward: bool
    marks_step_boundary: bool
    joins_uneven_inputs: bool

    @property
    def distributed_type(self) -> DistributedType | None:
        """The Accelerate type the strategy runs, ``None`` where the launch decides it."""

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        """The FSDP settings the strategy shards with, ``None`` without FSDP."""

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The mesh sizes in use, ``None`` without a ``ParallelismConfig``."""

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The device mesh, ``None`` without one."""

    def configure_from_prepare(
        self,
        batch_sizes: Sequence[int | None],
        *,
        split_batches: bool,
        torch_optimizer: bool,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        """Complete the engine's configuration from an ``Accelerator.prepare`` call that holds a model.

        By default there is nothing to configure: the engine does not depend on the ``prepare`` call.
        """
        return None

    def step_boundary(self, sync_gradients: bool) -> AbstractContextManager[None]:
        """A context telling the engine whether the backward pass inside ends an accumulation (by default empty)."""
        return nullcontext()

    def step_engine(self) -> StepEngine | None:
        """The engine that steps inside ``backward`` (``None`` without one, or before the model is set up)."""
        return None

    def checkpoint_engine(self) -> EngineCheckpoint | None:
        """The handler that writes the engine's own model and optimizer files.

        ``None`` by default: the shim saves the model and optimizers itself.
        """
        return None

    def data_parallel_shards(self) -> tuple[int, int] | None:
        """``(num_replicas, rank)`` of the data-parallel group, ``None`` (the default) to shard over every process."""
        return None

    def mesh_rank(self, dimension: str) -> int:
        """The coordinate of this process along a device-mesh dimension (``"tp"``, ``"dp_replicate"``, ...).

        Without a mesh (the default) every coordinate is 0.
        """
        return 0

    def context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> AbstractContextManager[None]:
        """A context sharding ``buffers`` along their sequence dimension over the mesh's ``cp`` dimension.

        Without context parallelism (the default) an empty context.
        """
        return nullcontext()

    def returned_model(self, wrapper: Module) -> Module:
        """What ``Accelerator.prepare`` hands back for a model set up into Fabric's ``wrapper`` (by default itself)."""
        return wrapper

    def pipeline(self) -> PipelineStep | None:
        """The pipeline schedule that runs a prepared model's whole training step in its forward.

        ``None`` by default: the prepared model's forward is the user's, and the script calls ``backward`` and the
        optimizer's ``step`` itself.
        """
        return None


class ShimStrategyDefaults(ShimStrategy):
    """The do-nothing answers to :class:`ShimStrategy`, for strategies without an engine of their own.

    List it last among a strategy's bases: Lightning's and the family adapters' members (``distributed_type``,
    ``fsdp_plugin``, ...) then take precedence over these defaults.
    """

    engine_steps_in_backward: bool = False
    marks_step_boundary: bool = False
    joins_uneven_inputs: bool = False
    distributed_type: Any = None
    fsdp_plugin: Any = None
    parallelism_config: Any = None
    torch_device_mesh: Any = None


class ContextBackwardSync(_BackwardSyncControl):
    """Fabric's ``no_backward_sync(module, enabled)``, answered by a family's own context (its ``no_sync``).

    Args:
        no_sync: ``no_sync(module, enabled)``, the context under which backward passes skip gradient synchronisation.

    """

    def __init__(self, no_sync: Callable[[Module, bool], AbstractContextManager[Any]]) -> None:
        self._no_sync = no_sync

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._no_sync(module, enabled)


class _ProcessGroupStrategy(Protocol):
    @property
    def distributed_sampler_kwargs(self) -> Mapping[str, Any] | None: ...


class ProcessGroupShards:
    """``data_parallel_shards`` from Lightning's ``distributed_sampler_kwargs`` (the strategy's data-parallel group).

    List it first among the bases of a multi-process strategy (DDP, FSDP, DeepSpeed, ``acc_parallel``, XLA).
    """

    def data_parallel_shards(self: _ProcessGroupStrategy) -> tuple[int, int] | None:
        """``(num_replicas, rank)`` of the strategy's sampler arguments, ``None`` when it has none."""
        kwargs = self.distributed_sampler_kwargs
        if not kwargs:
            return None
        return int(kwargs["num_replicas"]), int(kwargs["rank"])


def as_shim_strategy(strategy: object) -> ShimStrategy:
    """``strategy`` seen through :class:`ShimStrategy`, checked once when the ``Accelerator`` builds it.

    Raises:
        TypeError: If ``strategy`` does not derive from :class:`ShimStrategyDefaults` (not an ``acc_*`` strategy).

    """
    if not isinstance(strategy, ShimStrategyDefaults):
        raise TypeError(
            f"lightning_accel.Accelerator runs on acc_* Fabric strategies, got {type(strategy).__name__}: add"
            " ShimStrategyDefaults (lightning_accel.strategies.protocol) to its bases and answer ShimStrategy."
        )
    return strategy
