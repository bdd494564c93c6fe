"""Accelerate's ``PartialState``, ``AcceleratorState`` and ``GradientState``: state shared within a process.

Each class keeps its attributes in one class-level dictionary (every instance sees the same values), as Accelerate's
do, so a data loader or optimizer wrapper reads the state the ``Accelerator`` set without holding a reference to it.
:func:`reset_state` empties all three; tests call it between cases so no state leaks from one test into the next.

The first ``PartialState()`` of a launched process joins the launch's process group, as Accelerate's does; an
``Accelerator`` then runs its Fabric strategy on that group and records what the strategy answers here.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import time
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

from lightning_accel.config._derived import DerivedAttribute
from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.state.gradient import GradientState
from lightning_accel.state.shared import SharedDict, ThreadLocalSharedDict, _SharedState

__all__ = [
    "AcceleratorState",
    "GradientState",
    "PartialState",
    "SharedDict",
    "ThreadLocalSharedDict",
    "destroy_process_group",
    "do_nothing",
    "is_initialized",
    "reset_state",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# The plugins AcceleratorState records (``None`` where the run has none).
_PLUGIN_KEYS = (
    "dynamo_plugin",
    "deepspeed_plugins",
    "fsdp_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "parallelism_config",
)


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
        from lightning_accel.launch_settings.env import parse_flag_from_env

        # Read at every instance, as Accelerate does: set by the launchers that own the process group.
        self.fork_launched = parse_flag_from_env("FORK_LAUNCHED")

    def _join_launch(self, cpu: bool, init_kwargs: dict[str, Any]) -> None:
        from lightning_accel.config.devices import backend_for_device, default_collective_backend
        from lightning_accel.launch_settings.env import torch_device_from_env

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
        self._share_configuration()

    def _share_configuration(self) -> None:
        """Hand what :meth:`_configure` recorded to a state that shares it (``AcceleratorState``: to PartialState)."""

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
        # Each wait is a collective that carries the body's error, so a failure on one side raises on every process.
        if not is_first:
            self._share_outcome(None)
        try:
            yield
        except Exception as err:
            self._share_outcome(err)
            raise
        self._share_outcome(None)
        if is_first:
            self._share_outcome(None)

    @staticmethod
    def _share_outcome(error: BaseException | None) -> None:
        from lightning_accel.state.shared_errors import raise_on_every_process

        raise_on_every_process(error, "main_process_first")

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

    def on_main_process(self, function: _F | None = None) -> _F:
        """Decorate ``function`` to run on the global main process only (elsewhere it returns ``None``).

        Raises:
            ValueError: Without a function (Accelerate's signature makes it optional).

        """
        return self._only_where(_decorated(function, "on_main_process"), lambda s: s.is_main_process)

    def on_local_main_process(self, function: _F | None = None) -> _F:
        """Decorate ``function`` to run on each node's main process only (see :meth:`on_main_process`)."""
        return self._only_where(_decorated(function, "on_local_main_process"), lambda s: s.is_local_main_process)

    @property
    def default_device(self) -> torch.device:
        """The device this machine trains on by default: the current accelerator's type, else the CPU."""
        return torch.device(_accelerator_type()) if torch.accelerator.is_available() else torch.device("cpu")

    def set_device(self) -> None:
        """Make :attr:`device` the current device of its type (a no-op on the CPU or without an index)."""
        if self.device.type != "cpu" and self.device.index is not None:
            torch.accelerator.set_device_index(self.device.index)

    def on_last_process(self, function: _F) -> _F:
        """Decorate ``function`` to run on the last process only."""
        return self._only_where(function, lambda s: s.is_last_process)

    def on_process(self, function: _F | None = None, process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on global rank ``process_index`` only (``@state.on_process(process_index=1)``).

        Raises:
            ValueError: If ``process_index`` is missing.

        """
        return self._on_index(function, "process_index", process_index)

    def on_local_process(self, function: _F | None = None, local_process_index: int | None = None) -> Any:
        """Decorate ``function`` to run on local rank ``local_process_index`` of each node (see :meth:`on_process`)."""
        return self._on_index(function, "local_process_index", local_process_index)

    def _on_index(self, function: _F | None, attribute: str, index: int | None) -> Any:
        """Run ``function`` where this state's ``attribute`` is ``index`` (a decorator factory without ``function``)."""
        wanted = _required_index(attribute, index)
        if function is None:
            return functools.partial(self._on_index, attribute=attribute, index=wanted)
        return self._only_where(function, lambda state: getattr(state, attribute) == wanted)

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


def _partial_state_answer(state: AcceleratorState, name: str) -> bool:
    """``PartialState()``'s answer under ``name`` (it stays after ``AcceleratorState._reset_state()``)."""
    return bool(getattr(PartialState(), name))


class AcceleratorState(PartialState):
    """:class:`PartialState` plus the run's precision, plugins and the strategy's distributed type.

    As in Accelerate it keeps its own dictionary, filled from :class:`PartialState`'s when first created (joining the
    launch if no ``PartialState`` did yet): the process description is the same, while ``distributed_type`` is the
    strategy's (``FSDP`` here, ``MULTI_CPU`` in ``PartialState``). The ``Accelerator`` records its precision and
    plugins here; a state created first on its own records the ones it is given.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (default ``"no"``); once recorded it cannot
            change without a reset.
        cpu: Use the CPU even where an accelerator is present (passed on to the first ``PartialState``).
        dynamo_plugin: The run's ``TorchDynamoPlugin``.
        deepspeed_plugin: The run's ``DeepSpeedPlugin`` (or a dict of named ones; the first is active).
        fsdp_plugin: The run's ``FullyShardedDataParallelPlugin``.
        torch_tp_plugin: Accelerate's deprecated tensor-parallel plugin (recorded only).
        megatron_lm_plugin: The run's ``MegatronLMPlugin``.
        parallelism_config: The run's ``ParallelismConfig``.
        **kwargs: ``torch.distributed.init_process_group`` arguments for the first ``PartialState``.

    Raises:
        ValueError: For an unknown precision, or one other than the precision already recorded.

    """

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        **kwargs: Any,
    ) -> None:
        partial = PartialState(cpu, **kwargs)
        _SharedState.__init__(self)
        first = "mixed_precision" not in self.__dict__
        for key, value in partial.__dict__.items():
            if key != "fork_launched":  # PartialState's, read through the property below
                self.__dict__.setdefault(key, value)
        recorded = None if first else str(self.__dict__["mixed_precision"])
        precision = _checked_precision(mixed_precision, recorded)
        if first:
            self.mixed_precision = precision
            self._record_plugins(
                dynamo_plugin=dynamo_plugin,
                deepspeed_plugins=deepspeed_plugin,
                fsdp_plugin=fsdp_plugin,
                torch_tp_plugin=torch_tp_plugin,
                megatron_lm_plugin=megatron_lm_plugin,
                parallelism_config=parallelism_config,
            )

    def _record_plugins(self, **plugins: Any) -> None:
        """Record the run's plugins (the ``Accelerator`` calls this with the ones its strategy uses)."""
        for name in _PLUGIN_KEYS:
            setattr(self, name, plugins.get(name))
        self.device_mesh = plugins.get("device_mesh")

    @property
    def deepspeed_plugin(self) -> Any:
        """The active ``DeepSpeedPlugin`` (the selected one of several), ``None`` without DeepSpeed."""
        plugins = self.__dict__.get("deepspeed_plugins")
        if not isinstance(plugins, dict):
            return plugins
        selected = [plugin for plugin in plugins.values() if getattr(plugin, "selected", False)]
        return selected[0] if selected else next(iter(plugins.values()), None)

    @property
    def is_fsdp2(self) -> bool:
        """Whether the run shards with FSDP2 (Accelerate's ``state.is_fsdp2``)."""
        plugin = self.__dict__.get("fsdp_plugin")
        version = getattr(plugin, "fsdp_version", None)
        return self.distributed_type == DistributedType.FSDP and version == 2

    # The process questions are PartialState's, so they keep their answers after ``AcceleratorState._reset_state()``
    # (as in Accelerate, whose AcceleratorState asks a ``PartialState()`` for them).
    fork_launched = DerivedAttribute(_partial_state_answer)
    use_distributed = DerivedAttribute(_partial_state_answer)
    is_main_process = DerivedAttribute(_partial_state_answer)
    is_local_main_process = DerivedAttribute(_partial_state_answer)
    is_last_process = DerivedAttribute(_partial_state_answer)

    @override
    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Generator[Any, None, None]:
        """:meth:`PartialState.split_between_processes` (it works after this state was reset)."""
        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as share:
            yield share

    @override
    def destroy_process_group(self, group: dist.ProcessGroup | None = None) -> None:
        """:meth:`PartialState.destroy_process_group` (it works after this state was reset, as in Accelerate)."""
        PartialState().destroy_process_group(group)

    @override
    def _share_configuration(self) -> None:
        # The processes are the same for both states; only the distributed type is the strategy's here.
        partial = PartialState()
        partial.debug, partial.device = self.debug, self.device

    @classmethod
    @override
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the run's state; with ``reset_partial_state`` also the processes (Accelerate's signature)."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def _decorated(function: _F | None, decorator: str) -> _F:
    if function is None:
        raise ValueError(
            f"PartialState().{decorator} needs the function to decorate: use @state.{decorator} (no parentheses)."
        )
    return function


def _checked_precision(requested: str | None, recorded: str | None) -> str:
    """The precision a state records: ``requested`` (lower-cased), else ``recorded``, else ``"no"``.

    Raises:
        ValueError: For an unknown name, or one that differs from the precision already recorded.

    """
    if requested is None:
        return recorded or PrecisionType.NO.value
    name = str(requested).lower()
    if name not in PrecisionType:
        raise ValueError(f"Unknown mixed_precision {requested!r}; expected one of {PrecisionType.list()}.")
    if recorded is not None and name != recorded:
        raise ValueError(
            f"AcceleratorState already records mixed_precision={recorded!r}, so it cannot become {name!r}: call"
            " reset_state() first, or pass mixed_precision to the first Accelerator / AcceleratorState."
        )
    return name


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Accept anything and return ``None`` (Accelerate's placeholder for functions skipped on other processes)."""
    del args, kwargs


def is_initialized() -> bool:
    """Whether an ``Accelerator`` (or a first ``AcceleratorState``) filled in the shared ``AcceleratorState``."""
    return AcceleratorState._shared_state != {}


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
    if isinstance(inputs, (list, tuple, torch.Tensor)) or _is_hf_dataset(inputs):
        return len(inputs)
    raise TypeError(
        "split_between_processes splits lists, tuples, tensors, dicts of them and `datasets.Dataset`s, got"
        f" {type(inputs).__name__}."
    )


def _is_hf_dataset(inputs: Any) -> bool:
    """Whether ``inputs`` is a Hugging Face ``datasets.Dataset`` (imported already wherever one exists)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(inputs, getattr(datasets, "Dataset", ()))


def _take(inputs: Any, start: int, stop: int, width: int) -> Any:
    if isinstance(inputs, dict):
        return {key: _take(value, start, stop, width) for key, value in inputs.items()}
    if _is_hf_dataset(inputs):  # its rows, selected; padding repeats the last row, as for a list
        rows = list(range(min(start, len(inputs)), min(stop, len(inputs))))
        return inputs.select(rows + [len(inputs) - 1] * max(0, width - len(rows)))
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


_GLOO_DRAIN_SECONDS = 0.05


def destroy_process_group() -> None:
    """Destroy the default process group, and DeepSpeed's cached groups with it where DeepSpeed set them up.

    DeepSpeed keeps its own references to the groups it derived (data parallel, world clone); torch's
    ``destroy_process_group`` alone leaves them stale, and a second DeepSpeed run in the same process fails on them.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # A gloo work object freed while the process group itself is being destroyed deadlocks: the destructor holds
    # the GIL and waits for gloo's worker thread, which waits for the GIL to free the work's tensors (torch issue
    # 56297; the group outlives this call inside any DDP reducer, and dies at interpreter exit). Collect cycles
    # (e.g. a caught collective error's traceback) and let the worker threads free the work that just completed.
    gc.collect()
    time.sleep(_GLOO_DRAIN_SECONDS)
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(deepspeed_comm, "cdb", None)
    if backend is not None and backend.is_initialized():
        deepspeed_comm.destroy_process_group()  # type: ignore[union-attr]  # the module is loaded: backend is set
    else:
        dist.destroy_process_group()


@atexit.register
def _destroy_at_exit() -> None:
    """Destroy a default process group still alive at exit, while the interpreter can still run its clean-up.

    Lightning's Trainer keeps the group after ``fit`` (for the next call), and a script may end without
    ``destroy_process_group``; gloo's worker threads torn down during interpreter finalization then abort the
    process now and then ("terminate called without an active exception") after it finished its work.
    """
    destroy_process_group()


def reset_state() -> None:
    """Forget every shared state of this process (tests call this between cases)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
