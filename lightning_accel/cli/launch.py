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

__all__ = ["LaunchPlan", "parallelism_settings", "plan_launch", "run_plan"]


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


def _rendezvous_args(settings: Mapping[str, Any]) -> list[str]:
    machines = settings.get("num_machines", 1)
    rank = settings.get("machine_rank", 0)
    address, port = settings.get("main_process_ip"), settings.get("main_process_port")
    if rank >= machines:
        raise ValueError(f"machine_rank must be below num_machines ({machines}), got {rank}")
    if machines == 1:
        if not port:  # no port, or 0: let torch.distributed.run pick a free one
            return ["--standalone"]
        return ["--master_addr", address or "127.0.0.1", "--master_port", str(port)]
    if not address or not port:
        raise ValueError(
            f"{machines} machines need main_process_ip and a non-zero main_process_port (the rank-0 machine's "
            f"address), got {address!r} and {port!r}"
        )
    args = ["--node_rank", str(rank), "--rdzv_backend", settings.get("rdzv_backend") or "static"]
    if settings.get("same_network"):
        return [*args, "--master_addr", address, "--master_port", str(port)]
    return [*args, "--rdzv_endpoint", f"{address}:{port}"]


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

    Raises:
        ValueError: If the settings describe nothing lightning_accel can run (a type without a strategy, an invalid
            plugin, an mpirun hostfile, a missing address for several machines, ...).

    """
    if not command:
        raise ValueError("no training script given: pass the script (and its arguments) after the options")
    if module and no_python:
        raise ValueError("--module and --no_python cannot be combined")
    _check_launchable(settings)
    per_node = _arguments.processes_per_node(settings)
    machines = settings.get("num_machines", 1)
    args = ["--nnodes", str(machines), "--nproc_per_node", str(per_node), *_rendezvous_args(settings)]
    args += [*torchrun_options, *(["--module"] if module else []), *(["--no_python"] if no_python else [])]
    return LaunchPlan(tuple([*args, *command]), _process_env(settings, cpu_threads), per_node, machines)


def run_plan(plan: LaunchPlan) -> int:
    """Start the workers with ``torch.distributed.run`` and wait for them.

    Returns:
        0 when every worker succeeded, 1 when one failed (``torch.distributed.run`` prints which and why).

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
        if args.rdzv_backend == "static" and not args.standalone and args.max_restarts > 0:
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
    above: see :mod:`lightning_accel.launch_settings.rendezvous`.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from lightning_accel.launch_settings.rendezvous import fresh_static_backend

    if args.master_port is None:
        args.master_port = _DEFAULT_PORT  # as torch.distributed.run does
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    config.rdzv_backend = fresh_static_backend()
    elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
