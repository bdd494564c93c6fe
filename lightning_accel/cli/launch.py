"""Plan and start a launch: settings to ``torch.distributed.run`` arguments and the processes' environment.

``lightning-accel launch`` builds a :class:`LaunchPlan` with :func:`plan_launch` and starts it with :func:`run_plan`,
which runs ``torch.distributed.run`` (the elastic launcher) in this process: it starts, watches and restarts the
workers; nothing here manages processes.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_accel.config import _arguments
from lightning_accel.config._settings import PLUGIN_BY_TYPE, section_settings
from lightning_accel.enums import DistributedType
from lightning_accel.launch_settings import env_from_settings
from lightning_accel.strategies.megatron_core import check_plugin as check_megatron_plugin
from lightning_accel.strategies.registry import entry_for
from lightning_accel.utils.launch import _CPU_THREAD_ENV, _DEFAULT_PORT, _VISIBLE_DEVICES

__all__ = [
    "DEFAULT_RDZV_TIMEOUT_S",
    "LaunchPlan",
    "cpu_for_absent_gpus",
    "parallelism_settings",
    "plan_launch",
    "rendezvous_conf",
    "run_plan",
]

# How long each machine waits for the others: torch.distributed.run's own default (static and c10d rendezvous), long
# enough for machines a scheduler starts minutes apart (image pulls, environment setup, imports), short enough that a
# machine that never comes is an error within minutes instead of a launch that waits until killed.
DEFAULT_RDZV_TIMEOUT_S = 600


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch runs.

    Attributes:
        torchrun_args: Arguments for ``torch.distributed.run``, ending with the command to run.
        env: Variables added to the workers' environment.
        processes_per_node: Workers on this machine.
        num_machines: Machines taking part.

    """

    torchrun_args: tuple[str, ...]
    env: dict[str, str]
    processes_per_node: int
    num_machines: int


def parallelism_settings(settings: Mapping[str, Any], use_flag: bool, *, in_file: bool) -> dict[str, Any]:
    """Apply ``--use_parallelism_config`` to merged launch settings, as ``accelerate launch`` does.

    The flag (or the config file's ``parallelism_config`` section) turns N-D parallelism on, and the sizes left out
    are 1. Without ``num_processes`` from the file or the command line, the sizes' product is the process count.

    Args:
        settings: Command-line settings over the config file's.
        use_flag: Whether ``--use_parallelism_config`` was given.
        in_file: Whether the config file has a ``parallelism_config`` section.

    Raises:
        ValueError: If ``--parallelism_config_*`` options are given with neither the flag nor a file section
            (``accelerate launch`` ignores them then).

    """
    merged = dict(settings)
    if not (use_flag or in_file):
        given = [f"--{s.name}" for s in section_settings("parallelism_config") if s.name in merged]
        if given:
            raise ValueError(
                f"{', '.join(given)} given without --use_parallelism_config (and the config file has no "
                "parallelism_config section); add --use_parallelism_config to train with these sizes"
            )
        return merged
    merged = _arguments.with_parallelism_defaults(merged)
    config = _arguments.parallelism_config(merged)
    if "num_processes" not in merged and config is not None and config.total_size > 1:
        merged["num_processes"] = config.total_size
    return merged


def _check_launchable(settings: Mapping[str, Any]) -> None:
    """Fail before starting anything when no worker could run these settings."""
    _arguments.check_supported(settings)
    dtype = _arguments.distributed_type(settings)
    if dtype is not None:
        entry_for(dtype)
    _check_devices_exist(settings)
    plugin = PLUGIN_BY_TYPE.get(dtype) if dtype is not None else None
    if plugin is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = plugin.build(settings)
        if dtype is DistributedType.MEGATRON_LM:  # settings the strategy does not implement, before any worker starts
            check_megatron_plugin(built)
    if settings.get("mpirun_hostfile"):
        raise ValueError(
            "mpirun_config.mpirun_hostfile is set, but lightning-accel launch starts processes with "
            "torch.distributed.run: run `lightning-accel launch --num_machines N --machine_rank R "
            "--main_process_ip IP --main_process_port P` on each machine instead, and remove mpirun_config"
        )
    launcher = settings.get("deepspeed_multinode_launcher")
    if settings.get("num_machines", 1) > 1 and launcher not in (None, "standard"):
        raise ValueError(
            f"deepspeed_multinode_launcher is {launcher!r}, but lightning-accel launch starts every machine with "
            "torch.distributed.run; set it to 'standard' and run lightning-accel launch on each machine"
        )


def cpu_for_absent_gpus(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``MULTI_GPU`` on a machine without CUDA devices becomes ``MULTI_CPU`` (gloo), with a warning saying so.

    ``accelerate launch --multi_gpu`` starts the same processes there (a script with ``Accelerator(cpu=True)`` then
    trains as one CPU group): on a CPU cluster it is the flag that gives several machines one group. The warning
    names the fix that silences it (``--cpu``, or ``distributed_type: MULTI_CPU``). Other device types are refused
    by the device check.
    """
    merged = dict(settings)
    if _arguments.distributed_type(merged) is not DistributedType.MULTI_GPU or merged.get("use_cpu"):
        return merged
    if _local_device_count("cuda") > 0:
        return merged
    ignored = f"; gpu_ids {merged['gpu_ids']!r} is ignored" if merged.get("gpu_ids") not in (None, "all") else ""
    warnings.warn(
        "distributed_type MULTI_GPU (--multi_gpu) asks for CUDA devices, but this machine has none: training on CPU "
        f"as MULTI_CPU (gloo process group){ignored}. Pass --cpu (or set distributed_type: MULTI_CPU in the config "
        "file) to launch on CPU without this warning",
        UserWarning,
        stacklevel=2,
    )
    merged.update(distributed_type=DistributedType.MULTI_CPU, use_cpu=True)
    return merged


def _local_device_count(device_type: str) -> int:
    """How many ``device_type`` devices this machine has (0 without the device's torch extension)."""
    import torch

    from lightning_accel.config.devices import BACKEND_BY_TYPE

    backend = next(b for b in BACKEND_BY_TYPE.values() if b.device_type == device_type)
    if backend.extension_missing():
        return 0
    backend.import_extension()
    module = getattr(torch, device_type, None)
    return int(module.device_count()) if module is not None and module.is_available() else 0


def _check_devices_exist(settings: Mapping[str, Any]) -> None:
    """Refuse a device data-parallel type (``MULTI_GPU``, ...) or ``gpu_ids`` naming devices this machine lacks.

    Without the check the workers would fall back to the CPU and train as ``MULTI_CPU``, not what was asked for.
    """
    device = _arguments.accelerator_name(settings)
    if device in ("cpu", "auto"):
        return
    dtype = _arguments.distributed_type(settings)
    label = dtype.value if dtype is not None else device
    count = _local_device_count(device)
    if count == 0:
        raise ValueError(
            f"distributed_type {label} trains on {device!r} devices, but this machine has none; train on CPU with "
            "`--cpu` (distributed_type MULTI_CPU), or launch on a machine with the devices"
        )
    gpu_ids = settings.get("gpu_ids")
    if gpu_ids in (None, "all"):
        return
    ids = [part.strip() for part in str(gpu_ids).split(",") if part.strip()]
    absent = [i for i in ids if not i.isdigit() or int(i) >= count]
    if absent:
        raise ValueError(
            f"gpu_ids {gpu_ids!r} names {absent}, but this machine has {count} {device!r} device(s) (ids 0 to "
            f"{count - 1}); pass ids that exist, or gpu_ids 'all'"
        )


def _rendezvous_args(settings: Mapping[str, Any], rdzv_conf: str | None) -> list[str]:
    machines = settings.get("num_machines", 1)
    rank = settings.get("machine_rank", 0)
    address, port = settings.get("main_process_ip"), settings.get("main_process_port")
    if rank >= machines:
        raise ValueError(f"machine_rank must be below num_machines ({machines}), got {rank}")
    if machines == 1:
        conf = ["--rdzv_conf", rdzv_conf] if rdzv_conf else []
        if not port:  # no port, or 0: let torch.distributed.run pick a free one
            return ["--standalone", *conf]
        return ["--master_addr", address or "127.0.0.1", "--master_port", str(port), *conf]
    if not address or not port:
        raise ValueError(
            f"{machines} machines need main_process_ip and a non-zero main_process_port (the rank-0 machine's "
            f"address), got {address!r} and {port!r}"
        )
    backend = settings.get("rdzv_backend") or "static"
    args = ["--node_rank", str(rank), "--rdzv_backend", backend, "--rdzv_conf", rendezvous_conf(settings, rdzv_conf)]
    if settings.get("same_network"):
        return [*args, "--master_addr", address, "--master_port", str(port)]
    return [*args, "--rdzv_endpoint", f"{address}:{port}"]


def rendezvous_conf(settings: Mapping[str, Any], rdzv_conf: str | None) -> str:
    """``--rdzv_conf`` for several machines: ``rdzv_conf`` with the rendezvous timeout added.

    The timeout is ``rdzv_timeout`` (default :data:`DEFAULT_RDZV_TIMEOUT_S`), under the key the backend reads
    (``timeout`` for ``static``, ``join_timeout`` for ``c10d`` and the others); a timeout ``rdzv_conf`` already sets,
    as ``accelerate launch --rdzv_conf timeout=N`` does, is kept.

    Raises:
        ValueError: If ``rdzv_conf`` is not ``key=value,...`` or sets another timeout than ``rdzv_timeout``.

    """
    key = "timeout" if (settings.get("rdzv_backend") or "static") == "static" else "join_timeout"
    pairs = [item.strip() for item in (rdzv_conf or "").split(",") if item.strip()]
    if any("=" not in item for item in pairs):
        raise ValueError(f"--rdzv_conf must be key=value pairs separated by commas, got {rdzv_conf!r}")
    given = dict(item.split("=", 1) for item in pairs)
    timeout = settings.get("rdzv_timeout")
    if key in given and timeout is not None and given[key].strip() != str(timeout):
        raise ValueError(
            f"--rdzv_conf sets {key}={given[key].strip()} and rdzv_timeout is {timeout}: give the rendezvous timeout "
            "once (--rdzv_timeout, or rdzv_timeout in the config file)"
        )
    if key not in given:
        pairs.append(f"{key}={timeout if timeout is not None else DEFAULT_RDZV_TIMEOUT_S}")
    return ",".join(pairs)


def _process_env(settings: Mapping[str, Any], cpu_threads: int) -> dict[str, str]:
    env = env_from_settings(settings)
    env["OMP_NUM_THREADS"] = str(cpu_threads)
    device = _arguments.accelerator_name(settings)
    if device == "cpu":
        env.update(_CPU_THREAD_ENV)
    gpu_ids = settings.get("gpu_ids")
    if gpu_ids not in (None, "all") and device != "cpu":
        env[_VISIBLE_DEVICES.get(device, "CUDA_VISIBLE_DEVICES")] = gpu_ids
    return env


def plan_launch(
    settings: Mapping[str, Any],
    command: Sequence[str],
    *,
    cpu_threads: int = 1,
    module: bool = False,
    no_python: bool = False,
    torchrun_options: Sequence[str] = (),
    rdzv_conf: str | None = None,
) -> LaunchPlan:
    """Check the settings and plan the launch.

    Args:
        settings: Merged settings (command line over config file), with ``distributed_type`` set (``None``: data
            parallel on the accelerator's devices).
        command: The training script (or module, or program) and its arguments.
        cpu_threads: ``OMP_NUM_THREADS`` for each worker.
        module: Run ``command[0]`` as a Python module (``python -m``).
        no_python: Run ``command[0]`` as a program, not with Python.
        torchrun_options: Further ``torch.distributed.run`` options (``--max_restarts 2``, ...).
        rdzv_conf: ``--rdzv_conf`` (``key=value,...``); with several machines the rendezvous timeout is added to it.

    Raises:
        ValueError: If the settings describe nothing lightning_accel can run (a type without a strategy, an invalid
            plugin, an mpirun hostfile, a missing address for several machines, ...).

    """
    if not command:
        raise ValueError("no training script given: pass the script (and its arguments) after the options")
    if module and no_python:
        raise ValueError("--module and --no_python cannot be combined")
    settings = cpu_for_absent_gpus(settings)
    _check_launchable(settings)
    per_node = _arguments.processes_per_node(settings)
    machines = settings.get("num_machines", 1)
    args = ["--nnodes", str(machines), "--nproc_per_node", str(per_node), *_rendezvous_args(settings, rdzv_conf)]
    args += [*torchrun_options, *(["--module"] if module else []), *(["--no_python"] if no_python else [])]
    return LaunchPlan(tuple([*args, *command]), _process_env(settings, cpu_threads), per_node, machines)


def run_plan(plan: LaunchPlan) -> int:
    """Start the workers with ``torch.distributed.run`` and wait for them.

    Returns:
        0 when every worker succeeded, 1 when one failed (``torch.distributed.run`` prints which and why).

    Raises:
        RendezvousTimeoutError: If, with several machines, some did not arrive within the rendezvous timeout.

    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.get_args_parser().parse_args(list(plan.torchrun_args))
    os.environ.update(plan.env)
    # A restart must not find the last attempt's keys: with the rendezvous store shared with the workers (torch's
    # default), the restarted workers' gloo/NCCL mesh can read a dead worker's address from it and fail with
    # "connectFullMesh failed ... Connection refused". Unshared, every rendezvous round gets a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        if args.rdzv_backend == "static" and not args.standalone and (args.max_restarts > 0 or args.nnodes != "1"):
            _run_static_with_fresh_stores(args)
        else:
            torchrun.run(args)
    except ChildFailedError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


def _run_static_with_fresh_stores(args: Any) -> None:
    """``torch.distributed.run`` with its static rendezvous replaced by one that gives every restart a new store.

    torch's static rendezvous (the agents meet on a fixed port) keeps one store for all attempts, the same fault as
    above, and waits for absent machines silently: see :mod:`lightning_accel.launch_settings.rendezvous`.

    Raises:
        RendezvousTimeoutError: If some machine did not arrive within the rendezvous timeout (naming it).

    """
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from lightning_accel.launch_settings.rendezvous import fresh_static_backend

    if args.master_port is None:
        args.master_port = _DEFAULT_PORT  # as torch.distributed.run does
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    config.rdzv_backend = fresh_static_backend()
    elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
