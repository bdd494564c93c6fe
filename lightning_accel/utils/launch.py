"""Mirror of ``accelerate.utils.launch``: the workers' environment for an ``accelerate launch`` namespace.

``lightning-accel launch`` itself plans and starts runs in :mod:`lightning_accel.cli.launch`.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

from lightning_accel.config._settings import SETTINGS
from lightning_accel.enums import DistributedType, DynamoBackend, PrecisionType
from lightning_accel.launch_settings import env_from_settings

__all__ = ["prepare_multi_gpu_env"]

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
_DEFAULT_PORT = 29500
_CPU_THREAD_ENV = {"KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}


def _visible_devices_variable() -> str:
    """The variable that restricts this machine's accelerators (the first family found, CUDA otherwise)."""
    from lightning_accel.utils import imports

    device = imports.first_available_device(("xpu", "mlu", "sdaa", "musa", "npu", "hpu", "neuron"))
    return _VISIBLE_DEVICES[device or "cuda"]


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
