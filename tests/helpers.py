"""Shared helpers for tests: free ports, a clean environment and a 2-process launcher with a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parent.parent
ACCELERATE_CONFIGS = Path(__file__).parent / "fixtures" / "accelerate_configs"

# Variables that a launcher (torchrun, SLURM, an earlier test) may leave behind and that would make Lightning believe
# it runs inside an existing distributed job.
_DISTRIBUTED_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
    "PL_GLOBAL_SEED",
)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without distributed-launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS and not k.startswith("ACCELERATE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_python(args: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` in a clean environment; fail with its output if it fails or times out."""
    cmd = [sys.executable, *args]
    try:
        proc = subprocess.run(cmd, env=clean_env(**extra_env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{err.stdout}\n{err.stderr}") from err
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited with {proc.returncode}:\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}")
    return proc


def wait_all(procs: list[subprocess.Popen[str]], timeout: float, what: str) -> list[str]:
    """Wait for processes started with ``start_new_session=True``; return their outputs (stdout, with stderr).

    Raises:
        AssertionError: If they outlast ``timeout`` seconds (every process group is then killed) or one fails.

    """
    outputs: list[str] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{what} did not finish in {timeout}s:\n" + "\n".join(outputs)) from None
    if any(proc.returncode != 0 for proc in procs):
        raise AssertionError(f"{what} failed:\n" + "\n".join(output[-6000:] for output in outputs))
    return outputs


def run_pythons_at_once(argvs: list[list[str]], timeout: float, what: str, **extra_env: str) -> list[str]:
    """Run ``python <argv>`` for each of ``argvs`` at the same time (one-process runs: 2 cores run two at once).

    Returns their outputs (stdout, with stderr), as :func:`wait_all`, which also says what raises.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=clean_env(**extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for argv in argvs
    ]
    return wait_all(procs, timeout, what)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Start ``nproc`` copies of ``tests/scripts/<script>`` with ``torch.distributed.run`` on a free loopback port."""
    return run_python(
        [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(SCRIPTS / script),
            *args,
        ],
        timeout=timeout,
    )


def torchrun_each(out: Path, script: str, timeouts: dict[int, float]) -> Path:
    """Run ``tests/scripts/<script> --out <out>`` under ``torch.distributed.run`` once per process count.

    Args:
        out: The folder the script writes its ``{variant}_rank{r}.pt`` results to.
        script: The script's file name in ``tests/scripts``.
        timeouts: Process count -> the seconds that run may take, in the order to run them.

    Returns:
        ``out``, for :func:`load_rank_results`.

    """
    for nproc, timeout in timeouts.items():
        torchrun(script, "--out", str(out), nproc=nproc, timeout=timeout)
    return out


def has_module(name: str) -> bool:
    """Whether ``name`` (a dotted module path) can be imported, without importing it."""
    import importlib.util

    parent = name.rpartition(".")[0]
    return (not parent or has_module(parent)) and importlib.util.find_spec(name) is not None


def accelerates_files(ours: list[str]) -> list[str]:
    """The names of a ``save_state`` folder of ours that HF accelerate writes too: all but our manifest.

    Raises:
        AssertionError: If ``ours`` has no ``checkpoint_manifest.json`` (``save_state`` writes one in every folder).

    """
    from lightning_accel.checkpoint.manifest import MANIFEST_NAME

    assert MANIFEST_NAME in ours, f"no {MANIFEST_NAME} among {ours}"
    return [name for name in ours if name != MANIFEST_NAME]


needs_megatron = pytest.mark.skipif(  # acc_megatron_lm's tests
    not has_module("megatron.core"), reason="megatron-core is not installed (the megatron extra)"
)


def load_rank_results(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Read the ``{variant}_rank{r}.pt`` files a multi-process test script saved: variant -> one result per rank."""
    import torch

    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*_rank*.pt")):
        name, rank = path.stem.rsplit("_rank", 1)
        found.setdefault(name, []).insert(int(rank), torch.load(path, weights_only=False))
    return found


def reset_accelerator_states() -> None:
    """Forget the shared state of HF accelerate's and lightning_accel's ``Accelerator`` (between two in one process)."""
    from accelerate.state import AcceleratorState, GradientState

    from lightning_accel.state import reset_state

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    reset_state()
