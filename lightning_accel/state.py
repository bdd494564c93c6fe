"""Accelerate's ``PartialState``, ``AcceleratorState`` and ``GradientState``: state shared within a process.

Each class keeps its attributes in one class-level dictionary (every instance sees the same values), as Accelerate's
do, so a data loader or optimizer wrapper reads the state the ``Accelerator`` set without holding a reference to it.
:func:`reset_state` empties all three; tests call it between cases so no state leaks from one test into the next.

The first ``PartialState()`` of a launched process joins the launch's process group, as Accelerate's does; an
``Accelerator`` then runs its Fabric strategy on that group and records what the strategy answers here.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from typing_extensions import override

from lightning_accel.config import GradientAccumulationPlugin
from lightning_accel.enums import DistributedType, PrecisionType

__all__ = ["AcceleratorState", "GradientState", "PartialState", "destroy_process_group", "reset_state"]

_F = TypeVar("_F", bound=Callable[..., Any])

# What AcceleratorState adds to the process description PartialState shares with it.
_RUN_KEYS = ("mixed_precision",)
_PROCESS_KEYS = (
    "distributed_type",
    "device",
    "num_processes",
    "process_index",
    "local_process_index",
    "debug",
    "fork_launched",
)
# The attributes each state always has once filled in (a missing one means the state was reset).
_STATE_ATTRIBUTES = {"PartialState": _PROCESS_KEYS, "AcceleratorState": _PROCESS_KEYS + _RUN_KEYS}


class _SharedState:
    """Instances share one attribute dictionary per class (the Borg pattern)."""

    _shared_state: ClassVar[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_shared_state" not in cls.__dict__:
            cls._shared_state = {}

    def __init__(self) -> None:
        self.__dict__ = self._shared_state

    @property
    def initialized(self) -> bool:
        """Whether the ``Accelerator`` (or the first user) filled in this state."""
        return bool(self._shared_state)

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the shared dictionary lacks: say why when the state was reset.
        if name in _STATE_ATTRIBUTES.get(type(self).__name__, ()):
            kind = type(self).__name__
            raise AttributeError(
                f"`{kind}` object has no attribute `{name}`. This happens if `{kind}._reset_state()` was called and"
                f" no `Accelerator` or `{kind}` was created since: create one before using it."
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


class PartialState(_SharedState):
    """Which process this is and how many there are; the process-control helpers.

    The first instance of a process joins the launch (see ``__init__``); the ``Accelerator`` refines it with what its
    strategy answers (the distributed type of FSDP or DeepSpeed, the device it trains on).
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        """Describe this process; the first instance joins the launch's process group, as Accelerate's does.

        Under torchrun, SLURM or another launcher Lightning detects, the first ``PartialState()`` of a process starts
        ``torch.distributed`` (unless something already did) on the device's collective backend, so ``process_index``
        and the collectives work before any ``Accelerator`` exists; an ``Accelerator`` created later runs on that
        process group. Without a launcher it describes one process.

        Args:
            cpu: Use the CPU even where an accelerator is present.
            **kwargs: ``torch.distributed.init_process_group`` arguments (``backend``, ``timeout``, ...).

        """
        super().__init__()
        if not self.initialized:
            self._join_launch(cpu, kwargs)
        from lightning_accel.utils.environment import parse_flag_from_env

        # Read at every instance, as Accelerate does: set by the launchers that own the process group.
        self.fork_launched = parse_flag_from_env("FORK_LAUNCHED")

    def _join_launch(self, cpu: bool, init_kwargs: dict[str, Any]) -> None:
        from lightning_accel.config.devices import backend_for_device, default_collective_backend
        from lightning_accel.utils.environment import torch_device_from_env

        environment = _launch_environment()
        env_device = None if cpu else torch_device_from_env()
        device_type = "cpu" if cpu or not torch.accelerator.is_available() else _accelerator_type()
        device_type = device_type if env_device is None else env_device.type
        world_size = environment.world_size() if environment is not None else 1
        if world_size == 1 and not dist.is_initialized():
            device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, 0)
            device = device if env_device is None else env_device
            self._configure(DistributedType.NO, device, num_processes=1, process_index=0, local_index=0)
            self.backend = None
            return
        entry = backend_for_device(device_type)
        backend = init_kwargs.pop("backend", None) or default_collective_backend(entry)
        local_rank = environment.local_rank() if environment is not None else 0
        if not dist.is_initialized():
            assert environment is not None
            os.environ.setdefault("MASTER_ADDR", environment.main_address)
            os.environ.setdefault("MASTER_PORT", str(environment.main_port))
            rank = environment.global_rank()
            dist.init_process_group(backend, rank=rank, world_size=world_size, **init_kwargs)
        device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, local_rank)
        device = device if env_device is None else env_device
        index, count = dist.get_rank(), dist.get_world_size()
        dtype = entry.distributed_type if count > 1 else DistributedType.NO  # a one-process group is not distributed
        self._configure(dtype, device, num_processes=count, process_index=index, local_index=local_rank)
        self.backend = dist.get_backend()

    def _configure(
        self,
        distributed_type: DistributedType,
        device: torch.device,
        *,
        num_processes: int,
        process_index: int,
        local_index: int,
        debug: bool = False,
    ) -> None:
        self.distributed_type = distributed_type
        self.debug = debug
        self.device = device
        self.num_processes = num_processes
        self.process_index = process_index
        self.local_process_index = local_index

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is the global main process (rank 0)."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the main process of its node."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest rank."""
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (under the process group's timeout)."""
        if self.use_distributed and dist.is_available() and dist.is_initialized():
            dist.barrier()

    def destroy_process_group(self, group: dist.ProcessGroup | None = None) -> None:
        """Destroy ``group`` (default: the default process group and DeepSpeed's groups derived from it).

        In a process started by ``debug_launcher`` (``fork_launched``) the launcher owns the default group, so
        destroying it without naming a group does nothing, as in Accelerate.
        """
        if group is None and self.fork_launched:
            return
        if group is not None:
            dist.destroy_process_group(group)
            return
        destroy_process_group()

    @contextmanager
    def main_process_first(self) -> Generator[None, None, None]:
        """Run the body on the main process first, then on the others."""
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self) -> Generator[None, None, None]:
        """Run the body on each node's main process first, then on the node's other processes."""
        yield from self._goes_first(self.is_local_main_process)

    def _goes_first(self, is_first: bool) -> Generator[None, None, None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def _only_where(self, function: _F, runs_here: Callable[[PartialState], bool]) -> _F:
        """Wrap ``function`` to run where ``runs_here(state)`` holds (checked at each call), else return ``None``."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = PartialState()
            return function(*args, **kwargs) if runs_here(state) or not state.use_distributed else None

        return wrapper  # type: ignore[return-value]

    def on_main_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on the global main process only (elsewhere it returns ``None``)."""
        return self._only_where(function, lambda s: s.is_main_process)

    def on_local_main_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on each node's main process only."""
        return self._only_where(function, lambda s: s.is_local_main_process)

    def on_last_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on the last process only."""
        return self._only_where(function, lambda s: s.is_last_process)

    def on_process(self, function: _F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on global rank ``process_index`` only (``@state.on_process(process_index=1)``).

        Raises:
            ValueError: If ``process_index`` is missing.

        """
        index = _required_index("process_index", process_index)
        if function is None:
            return functools.partial(self.on_process, process_index=index)
        return self._only_where(function, lambda s: s.process_index == index)

    def on_local_process(self, function: _F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on local rank ``local_process_index`` of every node only.

        Raises:
            ValueError: If ``local_process_index`` is missing.

        """
        index = _required_index("local_process_index", local_process_index)
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=index)
        return self._only_where(function, lambda s: s.local_process_index == index)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Generator[Any, None, None]:
        """Yield this process's contiguous share of ``inputs`` (a list, tuple, tensor, or dict of them).

        The first ``len % num_processes`` processes get one extra element. With ``apply_padding``, shorter shares
        repeat the last element of ``inputs`` so every process gets the same count (drop those after gathering).

        Raises:
            ValueError: If the values of a dict differ in length.
            TypeError: For other input types.

        """
        if self.num_processes == 1:
            yield inputs
            return
        length = _split_length(inputs)
        per_process, extras = divmod(length, self.num_processes)
        start = self.process_index * per_process + min(self.process_index, extras)
        stop = start + per_process + (1 if self.process_index < extras else 0)
        width = per_process + (1 if extras else 0) if apply_padding else 0
        yield _take(inputs, start, stop, width)


class AcceleratorState(PartialState):
    """:class:`PartialState` plus the run's precision and the strategy's distributed type.

    As in Accelerate it keeps its own dictionary, filled from :class:`PartialState`'s when first created (joining the
    launch if no ``PartialState`` did yet): the process description is the same, while ``distributed_type`` is the
    strategy's (``FSDP`` here, ``MULTI_CPU`` in ``PartialState``).

    Args:
        cpu: Use the CPU even where an accelerator is present (passed on to the first ``PartialState``).
        **kwargs: ``torch.distributed.init_process_group`` arguments for the first ``PartialState``.

    """

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        partial = PartialState(cpu, **kwargs)
        _SharedState.__init__(self)
        for key, value in partial.__dict__.items():
            self.__dict__.setdefault(key, value)
        self.fork_launched = partial.fork_launched
        if "mixed_precision" not in self.__dict__:
            self.mixed_precision = PrecisionType.NO.value

    @override
    def _configure(
        self,
        distributed_type: DistributedType,
        device: torch.device,
        *,
        num_processes: int,
        process_index: int,
        local_index: int,
        debug: bool = False,
    ) -> None:
        super()._configure(
            distributed_type,
            device,
            num_processes=num_processes,
            process_index=process_index,
            local_index=local_index,
            debug=debug,
        )
        # The processes are the same for both states; only the distributed type is the strategy's here.
        partial = PartialState()
        partial.debug, partial.device = debug, device

    @classmethod
    @override
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the run's state; with ``reset_partial_state`` also the processes (Accelerate's signature)."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


class GradientState(_SharedState):
    """Gradient-accumulation settings and the live state of the loop.

    Attributes:
        sync_gradients: Whether the current micro-step synchronises gradients and steps the optimizer.
        plugin_kwargs: The accumulation plugin's non-default fields (Accelerate stores ``to_kwargs()``, so its
            getters' own defaults apply to the rest: ``adjust_scheduler`` reads ``False`` unless set).

    Args:
        gradient_accumulation_plugin: Settings of the run; only the first instance of a process applies them.

    """

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None) -> None:
        super().__init__()
        if not self.initialized:
            self.sync_gradients = True
            self._references: list[weakref.ref[Any]] = []
            self.plugin_kwargs: dict[str, Any] = {}
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def adjust_scheduler(self) -> bool:
        """Whether a skipped scheduler step still advances its counter."""
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the last batch of a data loader always synchronises."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised at every micro-batch."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_dataloader(self) -> Any | None:
        """The innermost data loader being iterated, if any."""
        live = [ref() for ref in self._references]
        live = [loader for loader in live if loader is not None]
        return live[-1] if live else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active data loader yielded (or is yielding) its last batch."""
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Samples in the active loader's last global batch (``-1`` when unknown or not iterating)."""
        loader = self.active_dataloader
        return -1 if loader is None else int(loader.remainder)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self._references = [*self._references, weakref.ref(dataloader)]

    def _remove_dataloader(self, dataloader: Any) -> None:
        self._references = [ref for ref in self._references if ref() is not dataloader and ref() is not None]


def _required_index(name: str, value: int | None) -> int:
    if value is None:
        raise ValueError(f"Pass {name}=<int>, e.g. @accelerator.on_process({name}=0).")
    return value


def _split_length(inputs: Any) -> int:
    if isinstance(inputs, dict):
        lengths = {key: len(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"split_between_processes needs dict values of one length, got lengths {lengths}.")
        return next(iter(lengths.values()), 0)
    if isinstance(inputs, (list, tuple, torch.Tensor)):
        return len(inputs)
    raise TypeError(
        f"split_between_processes splits lists, tuples, tensors and dicts of them, got {type(inputs).__name__}."
    )


def _take(inputs: Any, start: int, stop: int, width: int) -> Any:
    if isinstance(inputs, dict):
        return {key: _take(value, start, stop, width) for key, value in inputs.items()}
    share = inputs[start:stop]
    missing = width - len(share)
    if missing <= 0 or len(inputs) == 0:
        return share
    if isinstance(inputs, torch.Tensor):
        return torch.cat([share, inputs[-1:].expand(missing, *inputs.shape[1:])])
    return share + type(share)([inputs[-1]] * missing)


def _launch_environment() -> ClusterEnvironment | None:
    """The launcher this process was started by, as Lightning detects it (``None``: started by hand)."""
    for environment in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment):
        if environment.detect():
            return environment()
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return LightningEnvironment()
    return None


def _accelerator_type() -> str:
    current = torch.accelerator.current_accelerator()
    return "cpu" if current is None else current.type


def destroy_process_group() -> None:
    """Destroy the default process group, and DeepSpeed's cached groups with it where DeepSpeed set them up.

    DeepSpeed keeps its own references to the groups it derived (data parallel, world clone); torch's
    ``destroy_process_group`` alone leaves them stale, and a second DeepSpeed run in the same process fails on them.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # Collect cycles first (e.g. a caught collective error's traceback): a gloo work object freed only at interpreter
    # exit deadlocks on the GIL.
    gc.collect()
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(deepspeed_comm, "cdb", None)
    if backend is not None and backend.is_initialized():
        deepspeed_comm.destroy_process_group()  # type: ignore[union-attr]  # the module is loaded: backend is set
    else:
        dist.destroy_process_group()


def reset_state() -> None:
    """Forget every shared state of this process (tests call this between cases)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
