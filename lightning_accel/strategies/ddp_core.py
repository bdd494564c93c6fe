"""The behaviour of the DDP family, written once and used by both the Trainer and the Fabric strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Protocol, TypedDict

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_accel.config import DistributedDataParallelKwargs, InitProcessGroupKwargs, TorchDynamoPlugin
from lightning_accel.config.devices import (
    DeviceBackend,
    backend_for_device,
    backend_for_type,
    default_collective_backend,
    import_collective_backend,
)
from lightning_accel.enums import DDPCommunicationHookType, DistributedType
from lightning_accel.launch_settings.submitit import check_submitit_tasks
from lightning_accel.lightning_compat import set_process_group_backend
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO
from lightning_accel.strategies.compile import apply_dynamo
from lightning_accel.strategies.lightning_arguments import StartMethod, check_keywords
from lightning_accel.strategies.placement import ClusterPlacement, ClusterReplicas
from lightning_accel.strategies.precision_adoption import bind_precision, strategy_precision
from lightning_accel.strategies.subprocess_launch import FollowsTheLauncher

# Backends torch can run on CPU tensors; anything else on CPU is a configuration mistake.
_CPU_COLLECTIVES = ("gloo", "mpi", "ccl")


class DDPFamily:
    """Process group, wrapping and communication hooks of one data-parallel strategy.

    Args:
        strategy_name: The registered name, used in error messages.
        distributed_type: The Accelerate type, or ``None`` to derive it from the device the strategy is given
            (``cpu`` gives ``MULTI_CPU``, ``cuda`` gives ``MULTI_GPU``, and so on).
        ddp_kwargs: How to build ``DistributedDataParallel`` and which communication hook to register.
        init_kwargs: How to create the process group (backend, init method, timeout).
        dynamo_plugin: ``torch.compile`` settings applied to the model before it is wrapped.

    """

    def __init__(
        self,
        strategy_name: str,
        distributed_type: DistributedType | str | None,
        ddp_kwargs: DistributedDataParallelKwargs | None,
        init_kwargs: InitProcessGroupKwargs | None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        self.strategy_name = strategy_name
        self.dynamo_plugin = dynamo_plugin
        self.ddp_kwargs = _check_instance(ddp_kwargs, DistributedDataParallelKwargs, "ddp_kwargs")
        self.init_kwargs = _check_instance(init_kwargs, InitProcessGroupKwargs, "init_kwargs")
        self.backend: DeviceBackend | None = None
        if distributed_type is not None:
            self.backend = backend_for_type(_parse_distributed_type(distributed_type))
            self.backend.require_extension(strategy_name)

    @property
    def distributed_type(self) -> DistributedType | None:
        """The Accelerate type, once known."""
        return None if self.backend is None else self.backend.distributed_type

    @property
    def timeout(self) -> timedelta:
        """The process-group timeout: ``init_kwargs.timeout`` or Lightning's default."""
        return self.init_kwargs.timeout if self.init_kwargs.timeout is not None else default_pg_timeout

    def torch_ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel`` (only those the user changed)."""
        return self.ddp_kwargs.to_kwargs()

    def check_devices(self, devices: Sequence[torch.device] | None) -> None:
        """Check that the devices Lightning chose fit this strategy; derive the type for ``acc_ddp``.

        Raises:
            ValueError: If the devices are of another type than the strategy's, or the collective backend cannot
                serve them.

        """
        if not devices:
            return
        device_type = devices[0].type
        if self.backend is None:
            self.backend = backend_for_device(device_type)
            self.backend.require_extension(self.strategy_name)
        elif device_type != self.backend.device_type:
            raise ValueError(
                f"Strategy {self.strategy_name!r} trains on {self.backend.device_type!r} devices, but the accelerator"
                f" gives {device_type!r} devices. Pass `accelerator={_accelerator_flag(self.backend.device_type)!r}`,"
                f" or pick the strategy for {device_type!r} (`strategy='acc_ddp'` chooses it from the accelerator)."
            )
        requested = self._requested_collective()
        if device_type == "cpu" and requested is not None and requested not in _CPU_COLLECTIVES:
            raise ValueError(
                f"InitProcessGroupKwargs(backend={requested!r}) cannot run on CPU devices; use one of"
                f" {', '.join(_CPU_COLLECTIVES)} (or leave `backend` unset to get gloo)."
            )
        self._check_comm_hook(device_type)

    def collective_backend(self, root_device: torch.device) -> str:
        """The ``torch.distributed`` backend: the one requested in ``init_kwargs``, else the device's default."""
        requested = self._requested_collective()
        if requested is not None:
            return requested
        backend = self.backend or backend_for_device(root_device.type)
        return default_collective_backend(backend)

    def init_process_group(
        self, cluster_environment: ClusterEnvironment, collective: str, root_device: torch.device
    ) -> None:
        """Create the default process group (a no-op if one exists), importing the device extension first."""
        if self.backend is not None:
            self.backend.import_extension()
        import_collective_backend(collective)
        _init_dist_connection(cluster_environment, collective, **self.process_group_kwargs(root_device))

    def process_group_kwargs(self, root_device: torch.device) -> dict[str, Any]:
        """Keyword arguments for ``torch.distributed.init_process_group`` besides backend, rank and world size."""
        kwargs: dict[str, Any] = {"timeout": self.timeout}
        if root_device.type != "cpu":
            kwargs["device_id"] = root_device
        if self.init_kwargs.init_method is not None:
            kwargs["init_method"] = self.init_kwargs.init_method
        return kwargs

    def wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Compile ``module`` as the dynamo plugin says, wrap it in DDP and register the communication hook."""
        module = apply_dynamo(module, self.dynamo_plugin)
        # Building DDP on a side stream avoids touching the default CUDA stream (as Lightning does).
        on_cuda = device_ids is not None and self.backend is not None and self.backend.device_type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream()) if on_cuda else nullcontext():
            ddp = DistributedDataParallel(module, device_ids=device_ids, **self.torch_ddp_kwargs())
        self.ddp_kwargs.register_comm_hook(ddp)
        return ddp

    def _requested_collective(self) -> str | None:
        return self.init_kwargs.to_kwargs().get("backend")

    def _check_comm_hook(self, device_type: str) -> None:
        bf16 = DDPCommunicationHookType.BF16
        if device_type == "cpu" and bf16 in (self.ddp_kwargs.comm_hook, self.ddp_kwargs.comm_wrapper):
            raise ValueError(
                "DistributedDataParallelKwargs(comm_hook/comm_wrapper='bf16') needs NCCL on CUDA (or XCCL on XPU);"
                " torch refuses it on CPU. Use 'fp16' or 'power_sgd' on CPU."
            )


class _Host(Protocol):
    """The parts of a Lightning parallel strategy (Trainer or Fabric) that :class:`DDPFamilyAdapter` uses."""

    _family: DDPFamily
    _process_group_backend: str | None
    cluster_environment: ClusterEnvironment | None

    @property
    def root_device(self) -> torch.device: ...

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    def _get_process_group_backend(self) -> str: ...


class ProcessGroupOptions(TypedDict, total=False):
    """The settings every DDP-family strategy takes: the process group's and the name shown in messages."""

    init_kwargs: InitProcessGroupKwargs | None
    strategy_name: str
    checkpoint_io: CheckpointIO | None


class DDPOptions(ProcessGroupOptions, total=False):
    """``acc_ddp``'s settings besides ``distributed_type`` (documented on the strategies in :mod:`.ddp`)."""

    ddp_kwargs: DistributedDataParallelKwargs | None
    dynamo_plugin: TorchDynamoPlugin | None
    start_method: StartMethod


_FAMILY_KEYS = ("strategy_name", "ddp_kwargs", "init_kwargs", "dynamo_plugin")


class DDPFamilyAdapter(ClusterPlacement, ClusterReplicas, FollowsTheLauncher):
    """What the Trainer and Fabric twins of a DDP-family strategy share, read from their ``_family``.

    Listed before Lightning's strategy among the bases, so its methods take precedence over Lightning's: the root
    device and the sampler's replicas come from the cluster environment (:mod:`.placement`).
    """

    _family: DDPFamily
    _process_group_backend: str | None

    @property
    def distributed_type(self) -> DistributedType | None:
        """The Accelerate type this strategy runs (known once the devices are)."""
        return self._family.distributed_type

    def _adopt_family(
        self, distributed_type: DistributedType | str | None, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Build the strategy's :class:`DDPFamily` from ``options``; the arguments for Lightning's ``DDPStrategy``."""
        check_keywords(self, options)
        own = {key: options.get(key) for key in _FAMILY_KEYS}
        self._family = DDPFamily(
            own["strategy_name"] or "acc_ddp",
            distributed_type,
            own["ddp_kwargs"],
            own["init_kwargs"],
            own["dynamo_plugin"],
        )
        lightning = {key: value for key, value in options.items() if key not in own}
        if lightning.get("checkpoint_io") is None:
            lightning["checkpoint_io"] = NamingTorchCheckpointIO()
        return {**lightning, "timeout": self._family.timeout, **self._family.torch_ddp_kwargs()}

    def _get_process_group_backend(self: _Host) -> str:
        return self._family.collective_backend(self.root_device)

    def _configure_launcher(self: _Host) -> None:
        """Check the devices Lightning chose (deriving the type for ``acc_ddp``) and bind the precision to them.

        A process Lightning's launcher starts ends when the launching process ends (``FollowsTheLauncher``).

        Raises:
            ValueError: In a task of a multi-task submitit local job without torch's variables, where Lightning
                would start processes of its own in each task (``check_submitit_tasks``).

        """
        if self.cluster_environment is None or not self.cluster_environment.creates_processes_externally:
            check_submitit_tasks()
        self._family.check_devices(self.parallel_devices)
        bind_precision(strategy_precision(self), self.parallel_devices)
        super()._configure_launcher()  # type: ignore[misc]  # FollowsTheLauncher's, then Lightning's

    def _init_process_group(self: _Host) -> None:
        """Choose the collective backend and create the default process group (world ranks already set)."""
        backend = self._get_process_group_backend()
        set_process_group_backend(self, backend)
        assert self.cluster_environment is not None
        self._family.init_process_group(self.cluster_environment, backend, self.root_device)


def _parse_distributed_type(value: DistributedType | str) -> DistributedType:
    if isinstance(value, DistributedType):
        return value
    try:
        return DistributedType(str(value).upper())
    except ValueError:
        allowed = ", ".join(t.value for t in DistributedType)
        raise ValueError(f"Unknown distributed_type {value!r}; expected one of {allowed}.") from None


def _check_instance(value: Any, cls: type, name: str) -> Any:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"`{name}` must be a {cls.__name__}, got {type(value).__name__}: {value!r}.")
    return value


def _accelerator_flag(device_type: str) -> str:
    return "gpu" if device_type == "cuda" else device_type
