"""Kill-and-restart runs under ``lightning-accel launch --max_restarts 1``, shared by the tests and the benchmark.

One run is ``tests/scripts/faults_restart.py`` (a 2-process Trainer run with ``CheckpointRotation`` and
``SeedableSampler``) or ``faults_restart_accelerator.py`` (the same through the ``Accelerator``, resuming with
``load_state(missing_ok=True, resume_position=True)``), started in one of three topologies:

- ``standalone``: one machine, no port given (torch's ``c10d`` rendezvous on a free port);
- ``fixed_port``: one machine with ``--main_process_port`` (torch's ``static`` rendezvous);
- ``two_nodes``: two ``lightning-accel launch`` processes on loopback, one worker each (``static``, node ranks 0, 1).

With ``kill_at_step``, rank 1 of the first attempt SIGKILLs itself; the run must still end with the weights of an
uninterrupted run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import SCRIPTS, clean_env, free_port, wait_all

TOPOLOGIES = ("standalone", "fixed_port", "two_nodes")
TRAINER_SCRIPT = "faults_restart.py"
ACCELERATOR_SCRIPT = "faults_restart_accelerator.py"
_CONFIG = Path(__file__).parent / "fixtures" / "accelerate_configs" / "multi_cpu.yaml"


def _node_commands(
    topology: str, script_name: str, project: Path, out: Path, kill_at_step: int | None
) -> list[list[str]]:
    launch = [sys.executable, "-m", "lightning_accel.cli", "launch", "--config_file", str(_CONFIG)]
    launch += ["--max_restarts=1", "--monitor_interval=1"]
    script = [str(SCRIPTS / script_name), f"--project={project}", f"--out={out}"]
    script += [f"--kill-at-step={kill_at_step}"] if kill_at_step is not None else []
    if topology == "standalone":
        return [[*launch, *script]]
    port = str(free_port())
    if topology == "fixed_port":
        return [[*launch, "--main_process_port", port, *script]]
    if topology == "two_nodes":
        nodes = ["--num_machines", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        return [[*launch, *nodes, "--machine_rank", str(rank), *script] for rank in (0, 1)]
    raise ValueError(f"unknown topology {topology!r}; expected one of {TOPOLOGIES}")


def run(
    topology: str,
    project: Path,
    out: Path,
    kill_at_step: int | None = None,
    timeout: float = 300,
    script: str = TRAINER_SCRIPT,
) -> str:
    """Run ``script`` (a name in ``tests/scripts``) in ``topology``; return the launchers' output.

    Raises:
        AssertionError: If a launcher fails or the run outlasts ``timeout`` seconds (every process is then killed).

    """
    env = clean_env()
    procs = [
        subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in _node_commands(topology, script, project, out, kill_at_step)
    ]
    return "\n".join(wait_all(procs, timeout, f"{topology} run"))


def mismatches(reference: Path, result: Path) -> list[str]:
    """Names of the tensors that differ between two saved state dicts (all of them if the keys differ)."""
    expected, got = torch.load(reference), torch.load(result)
    if expected.keys() != got.keys():
        return sorted(set(expected) ^ set(got))
    return [key for key in expected if not torch.equal(expected[key], got[key])]
