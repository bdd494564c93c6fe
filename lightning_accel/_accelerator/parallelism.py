"""The ``Accelerator``'s parallelism members: the mesh, the rank along each dimension, context parallelism, the engine.

With ``Accelerator(parallelism_config=ParallelismConfig(...))`` the Fabric runs the ``acc_parallel`` strategy, which
builds Accelerate's device mesh when the processes start and answers the rank questions; the members here read the
strategy and the shared state, which records the plugins the strategy uses. Data loaders are sharded over the mesh's
``dp`` dimension (:func:`data_shards`): processes that differ only in their ``tp`` or ``cp`` coordinate read the same
batches, as in Accelerate.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accel.config import ParallelismConfig
from lightning_accel.state import AcceleratorState, PartialState
from lightning_accel.strategies.protocol import ShimStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Parallelism", "apply_model_tp_plan", "data_shards", "recorded_plugins"]


def recorded_plugins(strategy: ShimStrategy, given: Mapping[str, Any]) -> dict[str, Any]:
    """The plugins the state records: the given ones, with the strategy's FSDP settings, config and mesh.

    ``acc_parallel`` fills the config in from the process count (all ones become ``dp_replicate``) and builds the mesh
    when the processes start; ``acc_fsdp`` and ``acc_parallel`` carry the FSDP plugin they shard with.
    """
    return {
        "dynamo_plugin": given.get("dynamo_plugin"),
        "deepspeed_plugins": given.get("deepspeed_plugin"),
        "fsdp_plugin": strategy.fsdp_plugin or given.get("fsdp_plugin"),
        "megatron_lm_plugin": given.get("megatron_lm_plugin"),
        "torch_tp_plugin": given.get("torch_tp_plugin"),
        "parallelism_config": strategy.parallelism_config or given.get("parallelism_config"),
        "device_mesh": strategy.torch_device_mesh,
    }


def data_shards(strategy: ShimStrategy) -> tuple[int, int]:
    """``(num_processes, process_index)`` to shard data loaders with: the strategy's data-parallel group.

    A multi-process strategy answers with its data-parallel group (the mesh's ``dp`` dimension for ``acc_parallel``,
    megatron's data-parallel group for ``acc_megatron_lm``, every process for DDP, FSDP and DeepSpeed), so
    tensor-parallel peers read the same batches; without one, loaders shard over all processes.
    """
    shards = strategy.data_parallel_shards()
    if shards is None:
        state = PartialState()
        return state.num_processes, state.process_index
    return shards


def _parallel_style(name: str, style: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(style, ParallelStyle):
        return style
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if style not in styles:
        raise ValueError(
            f"tp_plan[{name!r}] = {style!r} is not a tensor-parallel style: use 'colwise', 'rowwise' or a"
            " torch.distributed.tensor.parallel.ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)."
        )
    return styles[style]()


def apply_model_tp_plan(model: Module, optimizers: list[Optimizer], mesh: DeviceMesh | None) -> None:
    """Split ``model`` over the mesh's ``tp`` dimension by the plan it carries (``model.tp_plan``), in place.

    The plan maps submodule names (or ``*`` patterns) to ``ParallelStyle`` objects or ``"colwise"``/``"rowwise"``.
    A model without a plan, one already split (DTensor parameters, e.g. ``parallelize_module`` called before
    ``prepare``) or a mesh without ``tp`` is left alone. ``optimizers`` built from the plain parameters are pointed at
    the split ones.

    Raises:
        TypeError: If ``model.tp_plan`` is not a mapping.
        ValueError: For an unknown style name.

    """
    from torch.distributed.tensor import DTensor

    plan = getattr(model, "tp_plan", None)
    if plan is None or mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return
    if not isinstance(plan, Mapping):
        raise TypeError(f"{type(model).__name__}.tp_plan must map submodule names to styles, got {plan!r}.")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_accel.strategies.fsdp_optimizers import optimizer_parameter_names, repoint_optimizers

    names = optimizer_parameter_names(model, optimizers)
    parallelize_module(model, mesh["tp"], {key: _parallel_style(key, value) for key, value in plan.items()})
    repoint_optimizers(model, optimizers, names)


class Parallelism:
    """The ``Accelerator``'s rank along a mesh dimension and its context-parallel block.

    Args:
        state: The shared process state, which records the plugins and mesh the strategy uses.
        strategy: The Fabric's strategy, which knows each process's coordinates on the mesh.

    """

    def __init__(self, *, state: AcceleratorState, strategy: ShimStrategy) -> None:
        self._state = state
        self._strategy = strategy
        self._warned_context_parallel = False

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The ``ParallelismConfig`` in use (with the sizes the processes fill in), ``None`` without one."""
        return self._state.__dict__.get("parallelism_config")

    def mesh_rank(self, dimension: str, enabled: str, what: str) -> int:
        """The strategy's rank along ``dimension``; 0 where the config leaves it at size 1, as in Accelerate."""
        config = self.parallelism_config
        if config is None:
            raise RuntimeError(
                f"{what} is not configured: pass Accelerator(parallelism_config=ParallelismConfig(...))."
            )
        if not getattr(config, enabled):
            return 0
        return self._strategy.mesh_rank(dimension)

    @contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Generator[None, None, None]:
        """Shard ``buffers`` over ``cp`` inside the block (see ``Accelerator.maybe_context_parallel``)."""
        config = self.parallelism_config
        if config is None or not config.cp_enabled or config.cp_backend != "torch":
            if not self._warned_context_parallel:
                self._warned_context_parallel = True
                warnings.warn(
                    "Context parallel training is not enabled, so maybe_context_parallel has no effect: set"
                    " ParallelismConfig(cp_size=...) > 1 to enable it.",
                    stacklevel=3,
                )
            yield
            return
        with self._strategy.context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
            yield
