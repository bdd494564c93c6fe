"""Plan and start a launch: settings to ``torch.distributed.run`` arguments and the processes' environment.

``lightning-accel launch`` builds a :class:`LaunchPlan` with :func:`plan_launch` and starts it with :func:`run_plan`,
which runs ``torch.distributed.run`` (the elastic launcher) in this process: it starts, watches and restarts the
workers; nothing here manages processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_accel.config import _arguments
from lightning_accel.config._settings import PLUGIN_BY_TYPE, SETTINGS
from lightning_accel.enums import DistributedType, DynamoBackend, PrecisionType
from lightning_accel.utils.environment import env_from_settings

__all__ = ["LaunchPlan", "plan_launch", "prepare_multi_gpu_env", "run_plan"]

# Which variable restricts the visible devices of each device type (what `gpu_ids` sets).
_VISIBLE_DEVICES = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "mlu": "MLU_VISIBLE_DEVICES",
    "musa": "MUSA_VISIBLE_DEVICES",
    "sdaa": "SDAA_VISIBLE_DEVICES",
    "hpu": "HABANA_VISIBLE_MODULES",
    "neuron": "NEURON_RT_VISIBLE_CORES",
}
_CPU_THREAD_ENV = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


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


def _check_launchable(settings: Mapping[str, Any]) -> None:
    """Fail before starting anything when no worker could run these settings."""
    from lightning_accel.strategies.registry import entry_for

    _arguments.check_supported(settings)
    dtype = _arguments.distributed_type(settings)
    if dtype is not None:
        entry_for(dtype)
    _arguments.accelerator_name(settings)
    plugin = PLUGIN_BY_TYPE.get(dtype) if dtype is not None else None
    if plugin is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plugin.build(settings)
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
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


# ---- Accelerate's launcher helper ---------------------------------------------------------------------------------

_DEFAULT_PORT = 29500


def _visible_devices_variable() -> str:
    """The variable that restricts this machine's accelerators (the first family found, CUDA otherwise)."""
    from lightning_accel.utils import imports

    for device, available in (
        ("xpu", imports.is_xpu_available),
        ("mlu", imports.is_mlu_available),
        ("sdaa", imports.is_sdaa_available),
        ("musa", imports.is_musa_available),
        ("npu", imports.is_npu_available),
        ("hpu", imports.is_hpu_available),
        ("neuron", imports.is_neuron_available),
    ):
        if available():
            return _VISIBLE_DEVICES[device]
    return _VISIBLE_DEVICES["cuda"]


def _set_rendezvous(args: argparse.Namespace) -> None:
    """Fill ``args`` with the ``torch.distributed.run`` options for its machines and port (Accelerate's fields)."""
    from lightning_accel.utils.other import get_free_port, is_port_in_use

    if args.main_process_port == 0:
        args.main_process_port = get_free_port()
    elif args.main_process_port is None:
        args.main_process_port = _DEFAULT_PORT
    port, machines = args.main_process_port, args.num_machines
    if machines > 1:
        args.nproc_per_node = str(args.num_processes // machines)
        args.nnodes = str(machines)
        args.node_rank = int(args.machine_rank)
        if getattr(args, "same_network", False):
            args.master_addr, args.master_port = str(args.main_process_ip), str(port)
        else:
            args.rdzv_endpoint = f"{args.main_process_ip}:{port}"
    else:
        args.nproc_per_node = str(args.num_processes)
        args.master_port = str(port)
    if (machines <= 1 or int(args.machine_rank) == 0) and is_port_in_use(port):
        if machines > 1:
            raise ConnectionError(
                f"main_process_port {port} is in use on this machine, and {machines} machines need that exact port; "
                "pass another --main_process_port (or free the port)"
            )
        args.standalone = True
        warnings.warn(
            f"main_process_port {port} is in use: this single-machine launch runs standalone on a free port instead; "
            "pass --main_process_port 0 to pick a free port, or another port",
            stacklevel=3,
        )


def _namespace_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The launch settings an ``accelerate launch`` namespace gives (attributes named as the settings)."""
    settings = {
        setting.name: setting.parse(f"--{setting.name}", getattr(args, setting.name))
        for setting in SETTINGS
        if getattr(args, setting.name, None) is not None
    }
    if args.use_fsdp and args.use_megatron_lm:
        raise ValueError("use_fsdp and use_megatron_lm are both set; a run uses one of them")
    if args.use_fsdp:
        settings["distributed_type"] = DistributedType.FSDP
    elif args.use_megatron_lm:
        settings["distributed_type"] = DistributedType.MEGATRON_LM
    else:
        settings["distributed_type"] = DistributedType.MULTI_GPU
    return settings


def _check_namespace(args: argparse.Namespace) -> None:
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be combined; pass one of them")
    if str(args.mixed_precision).lower() not in PrecisionType.list():
        raise ValueError(f"Unknown mixed_precision {args.mixed_precision!r}; choose one of {PrecisionType.list()}")
    if str(args.dynamo_backend).upper() not in DynamoBackend.list():
        raise ValueError(f"Unknown dynamo_backend {args.dynamo_backend!r}; choose one of {DynamoBackend.list()}")
    if str(args.mixed_precision).lower() == PrecisionType.FP8:
        from lightning_accel.utils.imports import is_fp8_available

        if not is_fp8_available():
            raise RuntimeError(
                "mixed_precision 'fp8' needs an fp8 backend: `pip install torchao` (or Transformer Engine)"
            )
    if args.use_fsdp and args.fsdp_cpu_ram_efficient_loading and not args.fsdp_sync_module_states:
        raise ValueError(
            "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: set --fsdp_sync_module_states true"
        )
    if getattr(args, "use_parallelism_config", False):
        raise ValueError(
            "use_parallelism_config is set, but lightning_accel's launcher has no ParallelismConfig environment yet; "
            "build the ParallelismConfig in the script instead"
        )


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """Accelerate's multi-process launch preparation: the workers' environment for an ``accelerate launch`` namespace.

    As in Accelerate, ``args`` is completed in place with ``torch.distributed.run``'s options: ``nproc_per_node``,
    ``master_port`` (one machine) or ``nnodes``/``node_rank`` with ``rdzv_endpoint`` (or ``master_addr``/``master_port``
    with ``same_network``). ``main_process_port`` 0 picks a free port, ``None`` means 29500; a busy port on one
    machine switches to ``standalone`` with a warning.

    Args:
        args: The parsed ``accelerate launch`` options (``num_processes``, ``num_machines``, ``machine_rank``,
            ``main_process_ip``/``_port``, ``mixed_precision``, ``dynamo_*``, ``use_fsdp`` with ``fsdp_*``,
            ``use_megatron_lm`` with ``megatron_lm_*``, ``gpu_ids``, ``debug``, ``num_cpu_threads_per_process``, ...).

    Returns:
        A copy of ``os.environ`` with the run's variables (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_*``,
        ``ACCELERATE_USE_FSDP`` and ``FSDP_*``, ``OMP_NUM_THREADS``, the visible-devices variable for ``gpu_ids``).

    Raises:
        ValueError: For an unknown precision or dynamo backend, ``--module`` with ``--no_python``, CPU-RAM-efficient
            FSDP loading without module-state sync, or a parallelism config.
        RuntimeError: For fp8 without an fp8 backend installed.
        ConnectionError: When the port of a multi-machine launch is in use on the main machine.

    """
    _set_rendezvous(args)
    _check_namespace(args)
    written = env_from_settings(_namespace_settings(args))
    written.pop("ACCELERATE_USE_CPU", None)  # Accelerate's multi-process launch leaves the device to the environment
    env = {**os.environ, **written}
    env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    gpu_ids = getattr(args, "gpu_ids", "all")
    if gpu_ids not in (None, "all"):
        env[_visible_devices_variable()] = str(gpu_ids)
    return env
