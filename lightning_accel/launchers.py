"""Accelerate's in-process launchers: ``notebook_launcher`` (several devices from a notebook) and ``debug_launcher``.

Both start real processes with torch's own machinery, as Accelerate's do: ``notebook_launcher`` runs the function under
``torch.distributed``'s elastic agent (``elastic_launch``: each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID``, which the ``Accelerator`` detects as a torchrun launch);
``debug_launcher`` forks CPU processes with ``torch.multiprocessing.start_processes`` and joins them in a gloo process
group through a file store, so multi-process code can be debugged on any machine.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_accel.enums import DistributedType, PrecisionType
from lightning_accel.launch_settings.patching import patch_environment
from lightning_accel.state import AcceleratorState, PartialState, reset_state
from lightning_accel.utils.imports import (
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_rocm_available,
    is_sdaa_available,
    is_xpu_available,
)
from lightning_accel.utils.other import get_free_port

__all__ = ["debug_launcher", "notebook_launcher", "test_launch"]

# Libraries that initialise the accelerator when imported, which breaks the forked workers.
_DEVICE_INITIALISING_LIBRARIES = ("bitsandbytes",)


def _device_type() -> str:
    """The accelerator family of this machine, found without initialising it (forked workers need that)."""
    for name, available in (
        ("mlu", is_mlu_available),
        ("sdaa", is_sdaa_available),
        ("musa", is_musa_available),
        ("npu", is_npu_available),
        ("hpu", is_hpu_available),
        ("xpu", is_xpu_available),
        ("neuron", is_neuron_available),
    ):
        if available():
            return name
    return "cuda"


def _in_hosted_notebook() -> tuple[bool, bool]:
    """Whether this runs in Google Colab, and whether in a Kaggle kernel."""
    kaggle = any(key.startswith("KAGGLE") for key in os.environ)
    colab = False
    if not kaggle and "IPython" in sys.modules:
        colab = "google.colab" in str(sys.modules["IPython"].get_ipython())
    return colab, kaggle


def _check_fresh_parent() -> None:
    """Refuse to fork workers from a process that already set up a run or initialised the device.

    Raises:
        ValueError: If an ``Accelerator`` (or ``PartialState``) was created in this process.
        RuntimeError: If a library that initialises the device on import was imported.

    """
    if AcceleratorState._shared_state or PartialState._shared_state:
        raise ValueError(
            "notebook_launcher starts the processes that each create the Accelerator, but this process already has "
            "one (or a PartialState): create it only inside the launched function, restart the notebook and rerun"
        )
    imported = [name for name in _DEVICE_INITIALISING_LIBRARIES if name in sys.modules]
    if imported:
        listed = "".join(f"\n\t* `{name}`" for name in imported)
        raise RuntimeError(
            "notebook_launcher cannot fork workers: libraries that initialise the device when imported are imported"
            " already. Please keep these imports inside your training function (then restart the notebook and"
            f" rerun):{listed}"
        )


def _launch_config(
    *,
    num_processes: int,
    num_nodes: int,
    node_rank: int,
    endpoint: str,
    rdzv_backend: str,
    rdzv_conf: dict[str, Any] | None,
    rdzv_id: str,
    max_restarts: int,
    monitor_interval: float,
    start_method: str,
    log_line_prefix_template: str | None,
) -> Any:
    """The elastic agent's ``LaunchConfig`` (a static rendezvous gets this node's rank)."""
    from torch.distributed.launcher.api import LaunchConfig

    from lightning_accel.launch_settings.rendezvous import fresh_static_backend

    configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        configs["rank"] = node_rank
        if max_restarts > 0:  # torch's static rendezvous would hand a restart the dead attempt's store
            rdzv_backend = fresh_static_backend()
    options: dict[str, Any] = {
        "min_nodes": num_nodes,
        "max_nodes": num_nodes,
        "nproc_per_node": num_processes,
        "run_id": rdzv_id,
        "rdzv_endpoint": endpoint,
        "rdzv_backend": rdzv_backend,
        "rdzv_configs": configs,
        "max_restarts": max_restarts,
        "monitor_interval": monitor_interval,
        "start_method": start_method,
        "log_line_prefix_template": log_line_prefix_template,
    }
    # LaunchConfig asks CUDA for its device count when no NUMA options are given, which would initialise CUDA in this
    # process before the workers are forked: give it options, then clear them (no NUMA binding, as before).
    has_numa = any(field.name == "numa_options" for field in dataclasses.fields(LaunchConfig))
    if has_numa:
        from torch.numa.binding import AffinityMode, NumaOptions

        options["numa_options"] = NumaOptions(AffinityMode.NODE)
    config = LaunchConfig(**options)
    if has_numa:
        config.numa_options = None
    return config


def _check_worker_environment(num_processes: int, start_method: str, device: str) -> None:
    """``ACCELERATE_DEBUG_MODE``: start empty workers first, to report a device initialised before the fork.

    Raises:
        RuntimeError: If the empty workers fail (with the reason).

    """
    from torch.multiprocessing import start_processes
    from torch.multiprocessing.spawn import ProcessRaisedException

    try:
        start_processes(_empty_worker, args=(), nprocs=num_processes, start_method=start_method)
    except ProcessRaisedException as err:
        raise _worker_failure(err, device, "Empty workers could not start, so the launch would fail too") from err


def _worker_failure(err: Exception, device: str, what: str) -> RuntimeError:
    """The error to raise for a forked worker's ``err``: the device-initialised-too-early fix, or ``what: err``."""
    if f"Cannot re-initialize {device.upper()} in forked subprocess" in str(err):
        return RuntimeError(
            f"{device.upper()} was initialised in this process before the workers were forked (usually by an "
            "import or a device call in an earlier cell): move it inside the launched function and restart"
        )
    return RuntimeError(f"{what}: {err}")


def _empty_worker(index: int) -> None:
    del index
    PartialState()


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes per node from a notebook (or any Python session).

    With more than one process, the workers are started by torch's elastic agent (forked, or spawned on XPU and ROCm)
    and create their ``Accelerator`` inside ``function``; nothing in this process may have created one or touched
    the device before. With one process, ``function`` runs here. In Colab without several GPUs it runs here too.
    ``ACCELERATE_DEBUG_MODE=true`` starts empty workers first to catch a device initialised before the fork.

    Args:
        function: The training function; it is called with ``*args`` in every process.
        args: Its positional arguments.
        num_processes: Processes on this node (required).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``, handed to the workers'
            ``Accelerator`` as ``ACCELERATE_MIXED_PRECISION``.
        use_port: The main process's port.
        master_addr: The main process's address.
        node_rank: This node's rank.
        num_nodes: Nodes taking part.
        rdzv_backend: Rendezvous: ``"static"`` or ``"c10d"``.
        rdzv_endpoint: The rendezvous endpoint (default ``master_addr:use_port`` for a static rendezvous).
        rdzv_conf: Further rendezvous settings.
        rdzv_id: The run's id.
        max_restarts: How often the agent restarts failed workers.
        monitor_interval: Seconds between the agent's checks of the workers.
        log_line_prefix_template: The agent's prefix of worker log lines.

    Raises:
        ValueError: For an unknown precision, a missing ``num_processes``, ``node_rank >= num_nodes``, or an
            ``Accelerator`` created before a multi-process launch.
        RuntimeError: If the device was initialised before the fork, or a worker failed (the agent's error attached).
        NotImplementedError: For a TPU in Colab or Kaggle (lightning_accel has no XLA launcher).

    """
    if str(mixed_precision).lower() not in PrecisionType.list():
        raise ValueError(f"Unknown mixed_precision {mixed_precision!r}; choose one of {PrecisionType.list()}")
    precision = str(mixed_precision).lower()
    colab, kaggle = _in_hosted_notebook()
    if (colab or kaggle) and (os.environ.get("TPU_NAME") is not None or os.environ.get("PJRT_DEVICE") == "TPU"):
        raise NotImplementedError(
            "notebook_launcher on a Colab/Kaggle TPU needs an XLA multiprocessing launcher, which lightning_accel does "
            "not have; run the notebook on GPUs or CPUs, or use HF accelerate for TPU notebooks"
        )
    if colab and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print(f"Launching training on one {'GPU' if torch.cuda.is_available() else 'CPU'}.")
        function(*args)
        return
    if num_processes is None:
        raise ValueError("notebook_launcher needs the number of processes: pass num_processes=...")
    if node_rank >= num_nodes:
        raise ValueError(f"node_rank ({node_rank}) must be below num_nodes ({num_nodes})")
    if num_processes > 1:
        _launch_workers(
            function,
            args,
            num_processes=num_processes,
            precision=precision,
            port=str(use_port),
            master_addr=master_addr,
            node_rank=node_rank,
            num_nodes=num_nodes,
            rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_conf=rdzv_conf,
            rdzv_id=rdzv_id,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            log_line_prefix_template=log_line_prefix_template,
        )
        return
    if is_mps_available():
        os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] = "1"
        print("Launching training on MPS.")
    elif torch.cuda.is_available():
        print("Launching training on one GPU.")
    elif torch.xpu.is_available():
        print("Launching training on one XPU.")
    else:
        print("Launching training on CPU.")
    function(*args)


def _launch_workers(
    function: Callable[..., Any],
    args: Sequence[Any],
    *,
    num_processes: int,
    precision: str,
    port: str,
    master_addr: str,
    node_rank: int,
    num_nodes: int,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_conf: dict[str, Any] | None,
    rdzv_id: str,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
) -> None:
    from torch.distributed.launcher.api import elastic_launch
    from torch.multiprocessing.spawn import ProcessRaisedException

    _check_fresh_parent()
    environment = {
        "NPROC": str(num_processes),
        "NODE_RANK": str(node_rank),
        "WORLD_SIZE": str(num_nodes * num_processes),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": port,
        "ACCELERATE_MIXED_PRECISION": precision,
    }
    with patch_environment(**environment):
        device = _device_type()
        start_method = "spawn" if device == "xpu" or is_rocm_available() else "fork"
        if os.environ.get("ACCELERATE_DEBUG_MODE", "false").lower() == "true":
            _check_worker_environment(num_processes, start_method, device)
        endpoint = rdzv_endpoint or (f"{master_addr}:{port}" if rdzv_backend == "static" else "")
        config = _launch_config(
            num_processes=num_processes,
            num_nodes=num_nodes,
            node_rank=node_rank,
            endpoint=endpoint,
            rdzv_backend=rdzv_backend,
            rdzv_conf=rdzv_conf,
            rdzv_id=rdzv_id,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
        )
        print(f"Launching training on {num_processes} {device.upper()}s.")
        try:
            elastic_launch(config=config, entrypoint=function)(*args)
        except ProcessRaisedException as err:
            raise _worker_failure(err, device, "A worker failed") from err


class _DebugWorker:
    """The body of each ``debug_launcher`` process: join the gloo group, record it in the state, run the function."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, index: int, *args: Any) -> None:
        world_size = int(os.environ["WORLD_SIZE"])
        os.environ.update(
            {"RANK": str(index), "LOCAL_RANK": str(index), "LOCAL_WORLD_SIZE": str(world_size), "FORK_LAUNCHED": "1"}
        )
        store = torch.distributed.FileStore(os.environ["ACCELERATE_DEBUG_RDV_FILE"], world_size)
        torch.distributed.init_process_group("gloo", rank=index, world_size=world_size, store=store)
        reset_state()  # the fork copied the parent's state
        PartialState()._configure(
            DistributedType.MULTI_CPU if world_size > 1 else DistributedType.NO,
            torch.device("cpu"),
            num_processes=world_size,
            process_index=index,
            local_index=index,
        )
        try:
            self.function(*args)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def debug_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` forked CPU processes joined in a gloo process group (debugging).

    Each process sees ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (a free port),
    ``ACCELERATE_USE_CPU=yes``, ``ACCELERATE_MIXED_PRECISION=no`` and ``GLOO_SOCKET_IFNAME=lo``; the process group
    exists before ``function`` runs, and ``PartialState()`` describes it (an ``Accelerator`` created inside uses it).
    The launcher owns that group (``FORK_LAUNCHED=1``, ``PartialState().fork_launched``): ``destroy_process_group()``
    and ``end_training()`` inside ``function`` leave it alone, and it is destroyed when ``function`` returns.

    Args:
        function: Called with ``*args`` in every process; forked, so it need not be picklable.
        args: Its positional arguments.
        num_processes: How many processes.

    Raises:
        ValueError: If ``num_processes`` is below 1.
        torch.multiprocessing.ProcessRaisedException: With the traceback of a process whose ``function`` raised.

    """
    from torch.multiprocessing import start_processes

    if num_processes < 1:
        raise ValueError(f"debug_launcher needs num_processes >= 1, got {num_processes}")
    with tempfile.TemporaryDirectory() as folder:
        environment = {
            "WORLD_SIZE": str(num_processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(get_free_port()),
            "ACCELERATE_MIXED_PRECISION": "no",
            "ACCELERATE_DEBUG_RDV_FILE": os.path.join(folder, "rendezvous"),
            "ACCELERATE_USE_CPU": "yes",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        with patch_environment(**environment):
            start_processes(_DebugWorker(function), args=tuple(args), nprocs=num_processes, start_method="fork")


def test_launch() -> None:
    """Check that this process can describe its launch (Accelerate's self-check): create the ``PartialState``."""
    PartialState()
