"""The behaviour of ``acc_parallel``, written once for the Trainer and Fabric strategies.

Accelerate 1.15 composes data replication, data sharding (FSDP2), context parallelism and tensor parallelism on one
torch ``DeviceMesh`` described by a :class:`~lightning_accel.config.ParallelismConfig`. This module checks the config
against the processes Lightning starts, builds that mesh (Accelerate's dimension names and order: ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``, plus the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp``), applies a tensor-parallel
plan to the ``tp`` dimension and FSDP2 (``fully_shard``) to the shard dimensions (HSDP when ``dp_replicate > 1``), and
answers Accelerate's rank questions. Checkpoints go through :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily`,
so ``acc_parallel`` writes the same ``torch.distributed.checkpoint`` directories as ``acc_fsdp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.nn import Module

from lightning_accel.config import FullyShardedDataParallelPlugin, ParallelismConfig
from lightning_accel.config.devices import BACKEND_BY_TYPE
from lightning_accel.enums import DistributedType
from lightning_accel.strategies.fsdp_core import FSDPFamily
from lightning_accel.strategies.lightning_arguments import check_keywords
from lightning_accel.strategies.placement import ClusterPlacement
from lightning_accel.strategies.precision_adoption import bind_precision, strategy_precision
from lightning_accel.strategies.subprocess_launch import FollowsTheLauncher

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TensorParallelPlan = Mapping[str, Any]
"""A ``parallelize_module`` plan: submodule names (or patterns) to ``ColwiseParallel()``, ``RowwiseParallel()``, ..."""


class ParallelFamily:
    """Mesh, tensor parallelism, FSDP2 and checkpoints for a :class:`ParallelismConfig`.

    Args:
        parallelism_config: The sizes of each dimension. ``None`` (or all sizes 1) replicates the model over every
            process, as Accelerate does (``dp_replicate_size`` becomes the number of processes).
        fsdp_plugin: FSDP2 settings for the shard dimensions (resharding, auto-wrap policy, mixed precision,
            state-dict type). ``None`` means FSDP2 defaults with sharded checkpoints.
        tp_plan: A plan applied with ``parallelize_module`` to the ``tp`` dimension before sharding; leave it out to
            parallelize the model yourself (``configure_model`` with ``self.device_mesh["tp"]``, or Fabric's
            ``parallelize_fn``).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``fsdp_plugin`` asks for FSDP1, which does not compose with a device mesh.

    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        tp_plan: TensorParallelPlan | None = None,
    ) -> None:
        if parallelism_config is not None and not isinstance(parallelism_config, ParallelismConfig):
            raise TypeError(
                f"`parallelism_config` must be a ParallelismConfig, got {type(parallelism_config).__name__}."
            )
        if parallelism_config is not None and parallelism_config.sp_enabled:
            raise ValueError(
                f"acc_parallel does not run DeepSpeed sequence parallelism (sp_size={parallelism_config.sp_size});"
                " set sp_size=1, or use acc_deepspeed."
            )
        if tp_plan is not None and not isinstance(tp_plan, Mapping):
            raise TypeError(f"`tp_plan` must map submodule names to ParallelStyles, got {type(tp_plan).__name__}.")
        self._fsdp = FSDPFamily(fsdp_plugin or FullyShardedDataParallelPlugin(fsdp_version=2))
        if self._fsdp.version != 2:
            raise ValueError(
                f"acc_parallel shards with FSDP2 on a device mesh, but fsdp_plugin has fsdp_version="
                f"{self._fsdp.version}; set FullyShardedDataParallelPlugin(fsdp_version=2)."
            )
        self.config = parallelism_config or ParallelismConfig()
        self.tp_plan = tp_plan
        self.mesh: DeviceMesh | None = None

    @property
    def checkpoints(self) -> FSDPFamily:
        """The FSDP family that reads and writes state dicts and checkpoints (``acc_fsdp``'s format)."""
        return self._fsdp

    def check_processes(self, world_size: int, device_type: str) -> None:
        """Fit the config to the processes Lightning starts, before any of them starts.

        An all-ones config replicates over ``world_size`` processes (Accelerate's ``_validate_accelerator``); the
        config is copied for that, the caller's object stays as it is.

        Raises:
            ValueError: If the sizes multiply to another number than ``world_size``, or context parallelism is asked
                for on CPU, where torch's ring attention has no kernel.

        """
        config = self.config
        if config.total_size == 1 and world_size > 1:
            config = self.config = dataclasses.replace(config, dp_replicate_size=world_size)
        if config.total_size != world_size:
            raise ValueError(
                f"ParallelismConfig total_size ({config.total_size} = dp_replicate {config.dp_replicate_size} x"
                f" dp_shard {config.dp_shard_size} x cp {config.cp_size} x tp {config.tp_size}) does not match the"
                f" {world_size} processes; adjust the sizes or the number of devices/nodes."
            )
        if config.cp_enabled and device_type == "cpu":
            raise ValueError(
                f"cp_size={config.cp_size} needs GPUs: torch's context_parallel (ring attention) has no CPU kernel"
                " (aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy, and the math backend"
                " mixes Tensors with DTensors). Set cp_size=1 on CPU, or train on CUDA devices."
            )

    def configure_launch(self, world_size: int, devices: list[torch.device] | None, precision: Any) -> None:
        """Before the processes start: fit the config to them (:meth:`check_processes`) and bind ``precision``."""
        assert devices is not None
        self.check_processes(world_size, devices[0].type)
        bind_precision(precision, devices)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the mesh (after the process group exists) with Accelerate's names and the flattened dimensions."""
        self.mesh = self.config.build_device_mesh(device_type)
        self.config.device_mesh = self.mesh
        if self.config.cp_enabled and self.config.cp_handler is not None:
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method(str(self.config.cp_handler.cp_comm_strategy))
        return self.mesh

    def distributed_type(self, device_type: str | None) -> DistributedType | None:
        """``FSDP`` when parameters are sharded (``dp_shard`` or ``cp``), else the multi-device type of ``device_type``.

        As in Accelerate, tensor parallelism alone (no FSDP plugin) keeps the multi-device type (``MULTI_GPU``).
        """
        config = self.config
        if config.dp_shard_enabled or config.cp_enabled:
            return DistributedType.FSDP
        if device_type is None:
            return None
        for dtype, backend in BACKEND_BY_TYPE.items():
            if backend.device_type == device_type:
                return dtype
        return None

    def sampler_kwargs(self) -> dict[str, int]:
        """``DistributedSampler`` arguments: each ``dp`` coordinate sees its own data, ``tp``/``cp`` ranks the same."""
        if self.mesh is None or not self.config.dp_dim_names:
            return {"num_replicas": 1, "rank": 0}
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def rank(self, dim: str) -> int:
        """The coordinate of this process along ``dim`` (0 when the dimension is not enabled, as in Accelerate).

        Raises:
            ValueError: If ``dim`` is not one of the mesh's dimension names.

        """
        known = self._enabled_dims()
        if dim not in known:
            raise ValueError(f"Unknown mesh dimension {dim!r}; expected one of {', '.join(known)}.")
        if self.mesh is None or not known[dim]:
            return 0
        return int(self.mesh[dim].get_local_rank())

    def _enabled_dims(self) -> dict[str, bool]:
        config = self.config
        return {
            "dp_replicate": config.dp_replicate_enabled,
            "dp_shard": config.dp_shard_enabled,
            "cp": config.cp_enabled,
            "sp": config.sp_enabled,
            "tp": config.tp_enabled,
            "dp": bool(config.dp_dim_names),
            "dp_shard_cp": bool(config.dp_shard_cp_dim_names),
            "dp_cp": bool(config.dp_cp_dim_names),
        }

    def parallelize(self, module: Module, device: torch.device, precision: Any = None) -> Module:
        """Apply the tensor-parallel plan and FSDP2 to ``module`` (unless already done), then materialize it.

        A module that already holds FSDP2 units (the user called ``fully_shard`` in ``configure_model`` or
        ``parallelize_fn``) is not sharded again; one that already holds tensor-parallel parameters does not get the
        plan again. Meta-device parameters are materialized on ``device`` afterwards (``reset_parameters``).

        Raises:
            ValueError: If ``tp_size > 1`` but nothing in the model is tensor parallel after the plan.

        """
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from torch.distributed.fsdp import FSDPModule

        config, mesh = self.config, self.mesh
        if mesh is None:
            return module
        if config.tp_enabled:
            if self.tp_plan is not None and not _has_tp_parameters(module, mesh):
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(module, mesh["tp"], dict(self.tp_plan))
            if not _has_tp_parameters(module, mesh):
                raise ValueError(
                    f"tp_size={config.tp_size}, but no parameter of {type(module).__name__} is split over the 'tp'"
                    " mesh dimension: pass tp_plan={'submodule': ColwiseParallel(), ...}, or call"
                    " parallelize_module(module, device_mesh['tp'], plan) in configure_model / parallelize_fn."
                )
        if not any(isinstance(m, FSDPModule) for m in module.modules()):
            fsdp_mesh = self.fsdp_mesh()
            if fsdp_mesh is not None:
                module = self._fsdp.wrap(module, device, fsdp_mesh.size(), precision, mesh=fsdp_mesh)
        _materialize_distributed_module(module, device)
        return module

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 runs on: ``dp_shard_cp``, with ``dp_replicate`` before it for HSDP; ``None`` for pure TP.

        With replication alone (DDP), the ``dp_replicate`` dimension is unflattened into ``(dp_replicate,
        dp_shard_cp=1)``, so FSDP2 all-reduces gradients across replicas and shards nothing.
        """
        config, mesh = self.config, self.mesh
        if mesh is None:
            return None
        if config.dp_shard_enabled or config.cp_enabled:
            return mesh[tuple(config.fsdp_dim_names)] if config.dp_replicate_enabled else mesh["dp_shard_cp"]
        if config.dp_replicate_enabled:
            replicas = mesh["dp_replicate"]
            return replicas._unflatten(0, (replicas.size(), 1), ("dp_replicate", "dp_shard_cp"))
        return None

    @contextmanager
    def context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Generator[None, None, None]:
        """Shard ``buffers`` along their sequence dimensions over ``cp`` inside the block.

        Accelerate's ``maybe_context_parallel``; does nothing when ``cp_size == 1``. Needs CUDA devices (see
        :meth:`check_processes`).
        """
        if self.mesh is None or not self.config.cp_enabled:
            yield
            return
        from torch.distributed.tensor.experimental import context_parallel

        with context_parallel(
            self.mesh["cp"], buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers
        ):
            yield


class _MeshRank:
    """A read-only property: this process's coordinate along one mesh dimension (see :meth:`ParallelFamily.rank`)."""

    def __init__(self, dim: str, doc: str) -> None:
        self.dim = dim
        self.__doc__ = doc

    def __get__(self, owner: ParallelFamilyAdapter | None, cls: type | None = None) -> int:
        if owner is None:
            raise AttributeError(self.dim)
        return owner._parallel.rank(self.dim)


class _OnDevices(Protocol):
    _parallel: ParallelFamily

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...


class ParallelOptions(TypedDict, total=False):
    """``acc_parallel``'s settings besides ``parallelism_config`` (documented on the strategies in :mod:`.parallel`)."""

    fsdp_plugin: FullyShardedDataParallelPlugin | None
    tp_plan: TensorParallelPlan | None
    strategy_name: str
    process_group_backend: str | None
    timeout: timedelta | None


class ParallelFamilyAdapter(ClusterPlacement, FollowsTheLauncher):
    """What the Trainer and Fabric ``acc_parallel`` strategies share, read from their ``_parallel``.

    The root device comes from the cluster environment's local rank (:mod:`.placement`); the sampler's replicas
    stay Lightning's (the data-parallel dimension of the mesh).
    """

    _parallel: ParallelFamily
    _checkpoint_label = "acc_parallel"
    strategy_name: str

    def _adopt_family(self, parallelism_config: ParallelismConfig | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """Build the strategy's :class:`ParallelFamily`; the arguments for Lightning's ``ModelParallelStrategy``."""
        check_keywords(self, options)
        self._parallel = ParallelFamily(parallelism_config, options.get("fsdp_plugin"), options.get("tp_plan"))
        self.strategy_name = options.get("strategy_name") or "acc_parallel"
        return {
            "save_distributed_checkpoint": not self._parallel.checkpoints.full_state_dict,
            "process_group_backend": options.get("process_group_backend"),
            "timeout": options.get("timeout", default_pg_timeout),
        }

    @property
    def _sharding(self) -> FSDPFamily:
        return self._parallel.checkpoints

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The sampler's replicas and rank: the data-parallel coordinates of this process on the mesh."""
        return self._parallel.sampler_kwargs()

    def _full_checkpoint_io(self) -> CheckpointIO:
        """Lightning's model-parallel strategies take no ``CheckpointIO``: full files go through torch's own."""
        from lightning.fabric.plugins import TorchCheckpointIO

        return TorchCheckpointIO()

    @property
    def parallelism_config(self) -> ParallelismConfig:
        """The sizes in use (replication filled in from the process count once the processes are known)."""
        return self._parallel.config

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin:
        """The FSDP2 settings for the shard dimensions."""
        return self._parallel.checkpoints.plugin

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The mesh (``None`` before the processes start, and with a single process); Accelerate's name."""
        return self._parallel.mesh

    data_parallel_rank = _MeshRank("dp_replicate", "Coordinate along ``dp_replicate`` (0 without replication).")
    data_parallel_shard_rank = _MeshRank("dp_shard", "Coordinate along ``dp_shard`` (0 without sharding).")
    tensor_parallel_rank = _MeshRank("tp", "Coordinate along ``tp`` (0 without tensor parallelism).")
    context_parallel_rank = _MeshRank(
        "cp", "Coordinate along ``cp`` (0 without context parallelism; Accelerate 1.15 raises ``NotImplementedError``)."
    )

    def _configure_launcher(self: _OnDevices) -> None:
        """Fit the config to the processes and bind the precision (:meth:`ParallelFamily.configure_launch`)."""
        self._parallel.configure_launch(
            self.num_nodes * self.num_processes, self.parallel_devices, strategy_precision(self)
        )
        super()._configure_launcher()  # type: ignore[misc]  # Lightning's, after this class in the MRO

    @property
    def distributed_type(self: _OnDevices) -> DistributedType | None:
        """``FSDP`` when anything is sharded or split, else the multi-device (DDP) type of the devices."""
        devices = self.parallel_devices
        return self._parallel.distributed_type(devices[0].type if devices else None)

    def context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Any:
        """See :meth:`ParallelFamily.context_parallel`."""
        return self._parallel.context_parallel(buffers, buffer_seq_dims, no_restore_buffers)


def _has_tp_parameters(module: Module, mesh: DeviceMesh) -> bool:
    """Whether some parameter of ``module`` is a DTensor on a mesh that includes the ``tp`` dimension."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in module.parameters())
