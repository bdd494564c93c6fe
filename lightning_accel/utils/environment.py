"""Accelerate's ``accelerate.utils.environment``: the machine and the launcher, read from variables and devices.

The functions here keep Accelerate's names and signatures (they read ``os.environ``, as Accelerate's do). GPU facts
come from ``nvidia-smi``, never from ``torch.cuda``, so that asking does not initialise CUDA before a fork. The
launch settings (the run's configuration from ``ACCELERATE_*`` variables, resolved against a config file) live in
:mod:`lightning_accel.launch_settings`, below the process state; they are re-exported here, where Accelerate and
earlier releases of this package put them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import torch
from packaging.version import parse

from lightning_accel import launch_settings
from lightning_accel.launch_settings import *  # noqa: F403
from lightning_accel.launch_settings.env import get_int_from_env, parse_flag_from_env
from lightning_accel.utils import imports
from lightning_accel.utils.imports import check_cuda_fp8_capability

__all__ = [
    *launch_settings.__all__,
    "CPUInformation",
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "get_cpu_distributed_information",
    "get_current_device_type",
    "get_driver_version",
    "get_gpu_info",
    "override_numa_affinity",
    "set_numa_affinity",
]

logger = logging.getLogger(__name__)

# Consumer GPUs whose P2P / InfiniBand transfers hang with drivers older than the one below (Accelerate's list).
_NO_P2P_DEVICES = ("RTX 40",)
_P2P_DRIVER = "550.40.07"


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among ``library_names`` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


def get_current_device_type() -> tuple[str, str]:
    """The accelerator's device type and its multi-process distributed type, without initialising any device.

    Checked in Accelerate's order: MLU, SDAA, MUSA, NPU, HPU, XPU, Neuron, and CUDA otherwise (also when there is no
    accelerator at all): ``("cuda", "MULTI_GPU")``, ``("npu", "MULTI_NPU")``, ...
    """
    device = imports.first_available_device(("mlu", "sdaa", "musa", "npu", "hpu", "xpu", "neuron"))
    return ("cuda", "MULTI_GPU") if device is None else (device, f"MULTI_{device.upper()}")


def _nvidia_smi() -> str:
    """The ``nvidia-smi`` command (on Windows, its default install path when it is not on ``PATH``)."""
    if platform.system() != "Windows":
        return "nvidia-smi"
    found = shutil.which("nvidia-smi")
    if found is not None:
        return found
    return f"{os.environ['SYSTEMDRIVE']}\\Program Files\\NVIDIA Corporation\\NVSMI\\nvidia-smi.exe"


def _query(field_name: str) -> list[str]:
    output = subprocess.check_output(
        [_nvidia_smi(), f"--query-gpu={field_name}", "--format=csv,noheader"], universal_newlines=True
    )
    return output.strip().split(os.linesep)


def get_gpu_info() -> tuple[list[str], int]:
    """``(names, count)`` of the NVIDIA GPUs, read from ``nvidia-smi`` (CUDA is not initialised).

    Raises:
        FileNotFoundError: Without ``nvidia-smi``.
        subprocess.CalledProcessError: If ``nvidia-smi`` fails.

    """
    rows = _query("count,name")
    return [row.split(",")[1].strip() for row in rows], len(rows)


def get_driver_version() -> str:
    """The NVIDIA driver version (of the first GPU), read from ``nvidia-smi``.

    Raises:
        FileNotFoundError: Without ``nvidia-smi``.
        subprocess.CalledProcessError: If ``nvidia-smi`` fails.

    """
    return _query("driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """``False`` on several RTX 40xx GPUs with a driver older than 550.40.07 (P2P and InfiniBand hang there).

    ``True`` otherwise, also when ``nvidia-smi`` is missing or fails (nothing known to be wrong), as in Accelerate.
    """
    try:
        names, count = get_gpu_info()
        if count > 1 and any(bad in name for name in names for bad in _NO_P2P_DEVICES):
            return parse(get_driver_version()) >= parse(_P2P_DRIVER)
    except Exception:
        pass
    return True


@dataclass
class CPUInformation:
    """Where this process sits in a multi-process CPU run (Accelerate's dataclass).

    Attributes:
        rank: The rank of this process.
        world_size: The number of processes.
        local_rank: The rank of this process on its node.
        local_world_size: The number of processes on this node.

    """

    rank: int = field(default=0, metadata={"help": "The rank of the current process."})
    world_size: int = field(default=1, metadata={"help": "The total number of processes in the world."})
    local_rank: int = field(default=0, metadata={"help": "The rank of the current process on the local node."})
    local_world_size: int = field(default=1, metadata={"help": "The total number of processes on the local node."})


def get_cpu_distributed_information() -> CPUInformation:
    """Rank and sizes from torchrun's variables or, failing those, MPI's (Intel MPI, Open MPI, MVAPICH)."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(
            ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0
        ),
        local_world_size=get_int_from_env(
            ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], 1
        ),
    )


def _parse_cpu_list(text: str) -> list[int]:
    """A sysfs CPU list (``"0-7,16-23"``) as CPU numbers."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "-" in part:
            start, end = part.split("-")
            cpus.extend(range(int(start), int(end) + 1))
        else:
            cpus.append(int(part))
    return cpus


def _gpu_affinity(local_process_index: int) -> list[int]:
    """The CPUs of the NUMA node of GPU ``local_process_index`` (from amdsmi on ROCm, NVML otherwise).

    Raises:
        ImportError: Without ``amdsmi`` on ROCm, or ``nvidia-ml-py`` (``pynvml``) on CUDA.

    """
    if imports.is_rocm_available():
        if not imports.is_amdsmi_available():
            raise ImportError(
                "Setting the CPU affinity of ROCm GPUs needs the amdsmi package, which ships with ROCm: put ROCm's "
                "Python bindings on PYTHONPATH."
            )
        import amdsmi

        amdsmi.amdsmi_init()
        try:
            handle = amdsmi.amdsmi_get_processor_handles()[local_process_index]
            node = amdsmi.amdsmi_topo_get_numa_node_number(handle)
            if node is None or node < 0:  # not bound to a NUMA node: every online CPU
                return sorted(os.sched_getaffinity(0))
            with open(f"/sys/devices/system/node/node{node}/cpulist", encoding="utf-8") as file:
                return _parse_cpu_list(file.read().strip())
        finally:
            amdsmi.amdsmi_shut_down()
    if not imports.is_pynvml_available():
        raise ImportError("Setting the CPU affinity of CUDA GPUs needs nvidia-ml-py: pip install nvidia-ml-py")
    import pynvml

    pynvml.nvmlInit()
    words = math.ceil((os.cpu_count() or 1) / 64)
    handle = pynvml.nvmlDeviceGetHandleByIndex(local_process_index)
    bits = "".join(f"{word:064b}" for word in reversed(pynvml.nvmlDeviceGetCpuAffinity(handle, words)))
    return [cpu for cpu, bit in enumerate(reversed(bits)) if bit != "0"]


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Bind this process to the CPUs of its GPU's NUMA node (a no-op without CUDA/ROCm GPUs).

    Args:
        local_process_index: This process's GPU on the node.
        verbose: Log the CPUs assigned; ``None`` follows ``ACCELERATE_DEBUG_MODE``.

    Raises:
        ImportError: Without ``amdsmi`` (ROCm) or ``nvidia-ml-py`` (CUDA) on a GPU machine.

    """
    if verbose is None:
        verbose = parse_flag_from_env("ACCELERATE_DEBUG_MODE", False)
    if not torch.cuda.is_available():
        return
    os.sched_setaffinity(0, _gpu_affinity(local_process_index))
    if verbose:
        cores = os.sched_getaffinity(0)
        logger.info(f"Assigning {len(cores)} cpu cores to process {local_process_index}: {cores}")


@functools.lru_cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """:func:`override_numa_affinity`, done once per process and arguments (cached, as in Accelerate)."""
    override_numa_affinity(local_process_index=local_process_index, verbose=verbose)
