"""The SLURM recipes of ``examples/slurm/`` (issue 32) under a simulated ``srun``, and under submitit's local executor.

No SLURM exists here: ``srun`` is simulated by starting the 2 processes of one node with the variables SLURM gives
each task (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NODELIST``,
``SLURM_JOB_ID``, ...), which Lightning's ``SLURMEnvironment`` and ``Accelerator()`` read. The one stand-in is
``scontrol``: a script on ``PATH`` that records its arguments. Every run is compared with the same example under
``torchrun --nproc_per_node 2``: the final weights are identical, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SCRIPTS, clean_env, free_port, torchrun, wait_all

SCRIPT = str(SCRIPTS / "slurm_example.py")
TIMEOUT = 180
JOB_ID = "4242"


def _example_args(kind: str, work: Path, out: Path) -> list[str]:
    folder = "--root" if kind == "trainer" else "--project"
    return [kind, "--", folder, str(work), "--out", str(out)]


def _slurm_env(rank: int, port: int, bin_dir: Path, **extra: str) -> dict[str, str]:
    """The variables ``srun`` gives task ``rank`` of a 2-task, 1-node job (plus the fake ``scontrol`` on PATH)."""
    return clean_env(
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODELIST="127.0.0.1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        MASTER_PORT=str(port),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SCONTROL_LOG=str(bin_dir / "scontrol.log"),
        **extra,
    )


def _srun(args: list[str], bin_dir: Path, **extra: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, *args],
            env=_slurm_env(rank, port, bin_dir, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder holding the fake ``scontrol``, which appends its arguments to ``$SCONTROL_LOG``."""
    folder = tmp_path / "bin"
    folder.mkdir()
    scontrol = folder / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    scontrol.chmod(0o755)
    return folder


@pytest.fixture(scope="module", params=["trainer", "accelerator"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    """The example's final weights under ``torchrun --nproc_per_node 2``, uninterrupted."""
    kind = request.param
    work = tmp_path_factory.mktemp(f"torchrun_{kind}")
    torchrun("slurm_example.py", *_example_args(kind, work / "run", work / "weights.pt"), timeout=TIMEOUT)
    yield kind, torch.load(work / "weights.pt", weights_only=True)


def _summary(kind: str, environment: str = "SLURMEnvironment") -> str:
    """The line process 0 prints at the end: the whole run on one group of 2 processes, found by ``environment``."""
    return (
        f"trained 3 epochs on 2 processes ({environment})" if kind == "trainer" else "trained 24 steps on 2 processes"
    )


def _assert_same_weights(path: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(path, weights_only=True)
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def _wait_for_files(paths: list[Path], procs: list[subprocess.Popen[str]], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
            _kill(procs)
            outputs = [proc.communicate()[0] for proc in procs]
            raise AssertionError(f"{what}: {[str(p) for p in paths]} never appeared:\n" + "\n".join(outputs))
        time.sleep(0.1)


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigusr1_saves_requeues_and_the_requeued_job_resumes(
    reference: tuple[str, dict], tmp_path: Path, bin_dir: Path
) -> None:
    """SIGUSR1 to both tasks at one point of training: a save, ``scontrol requeue <job>``; the rerun resumes.

    The requeued run is a whole ``srun`` run too: one group of 2 processes found by ``SLURMEnvironment`` (its summary
    line), ending with ``torchrun``'s weights and no second requeue.
    """
    kind, weights = reference
    work, out, ready = tmp_path / "run", tmp_path / "weights.pt", tmp_path / "ready"
    pause = ["--pause-at", "0" if kind == "trainer" else "9", "--ready", str(ready)]
    first = _srun([*pause, *_example_args(kind, work, out)], bin_dir)
    _wait_for_files([ready / "ready_0", ready / "ready_1"], first, "the first run")
    for proc in first:
        proc.send_signal(signal.SIGUSR1)  # SLURM signals every task of the job (--signal=SIGUSR1@90)
    log = bin_dir / "scontrol.log"
    if kind == "trainer":  # Lightning saves in its handler and training goes on: SLURM would now end the job
        _wait_for_files([log], first, "the requeue")
        _kill(first)
        for proc in first:
            proc.communicate(timeout=TIMEOUT)
        assert (work / "hpc_ckpt_1.ckpt").exists()
    else:  # the loop saves after the step every process stops at, and exits
        wait_all(first, TIMEOUT, "the preempted loop")
        assert [p.name for p in sorted((work / "checkpoints").iterdir())] == ["checkpoint_0"]
    assert log.read_text() == f"requeue {JOB_ID}\n"
    assert not out.exists()

    outputs = wait_all(_srun(_example_args(kind, work, out), bin_dir, SLURM_RESTART_COUNT="1"), TIMEOUT, "requeued")
    _assert_same_weights(out, weights)
    assert _summary(kind) in outputs[0]
    if kind == "trainer":
        assert f"Restored all states from the checkpoint at {work / 'hpc_ckpt_1.ckpt'}" in outputs[0]
    assert log.read_text() == f"requeue {JOB_ID}\n"  # the requeued run ended normally


def test_submitit_local_executor_trains_as_torchrun(reference: tuple[str, dict], tmp_path: Path) -> None:
    """``examples/slurm/submit.py --local``: submitit's ``AutoExecutor(cluster="local")`` with 2 tasks."""
    pytest.importorskip("submitit")
    kind, weights = reference
    out = tmp_path / "weights.pt"
    folder = "--root" if kind == "trainer" else "--project"
    submit = [str(REPO / "examples" / "slurm" / "submit.py"), kind, "--local", "--logs", str(tmp_path / "logs")]
    process = subprocess.Popen(
        [sys.executable, *submit, "--", folder, str(tmp_path / "run"), "--out", str(out)],
        env=clean_env(MASTER_PORT=str(free_port())),  # else submitit derives a port from the job id
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the timeout kills submitit's job controller and its tasks with it
    )
    wait_all([process], TIMEOUT, f"submitit {kind}")
    _assert_same_weights(out, weights)
    task_logs = sorted((tmp_path / "logs").glob("*_0_log.out"))
    # torch's variables, exported from submitit's: Lightning's default environment reads them
    assert _summary(kind, "LightningEnvironment") in task_logs[0].read_text()


def test_torchrun_in_two_pods_with_the_pytorch_operators_variables_trains_as_torchrun(
    reference: tuple[str, dict], tmp_path: Path
) -> None:
    """Kubeflow's PyTorchJob gives each pod ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
    ``PET_MASTER_PORT``, which ``torchrun`` reads as its options: two pods of one process train as 2 processes do.
    """
    kind, weights = reference
    out = tmp_path / "weights.pt"
    port = str(free_port())
    args = _example_args(kind, tmp_path / "run", out)
    if kind == "trainer":
        args += ["--devices", "1", "--num_nodes", "2"]
    pods = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", SCRIPT, *args],
            env=clean_env(PET_NNODES="2", PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    outputs = wait_all(pods, TIMEOUT, f"two pods, {kind}")
    _assert_same_weights(out, weights)
    assert _summary(kind, "TorchElasticEnvironment") in outputs[0]


@pytest.mark.parametrize("kind", ["trainer", "accelerator"])
def test_the_sbatch_scripts_run_the_tested_examples_with_requeue_on_sigusr1(kind: str) -> None:
    """What the tests above run under a simulated ``srun`` is what each sbatch script's ``srun`` line starts."""
    sbatch = (REPO / "examples" / "slurm" / f"{kind}.sbatch").read_text()
    options = [line.split()[1] for line in sbatch.splitlines() if line.startswith("#SBATCH")]
    assert {"--signal=SIGUSR1@90", "--requeue", "--ntasks-per-node=2"} <= set(options)
    assert f"srun python examples/slurm/train_{kind}.py " in sbatch


@pytest.mark.parametrize("reference", ["accelerator"], indirect=True)
def test_sigterm_saves_the_loop_without_a_requeue_and_the_rerun_resumes(
    reference: tuple[str, dict], tmp_path: Path, bin_dir: Path
) -> None:
    """SIGTERM (SLURM preempting or cancelling): the loop saves and stops, but leaves the requeue to SLURM."""
    kind, weights = reference
    work, out, ready = tmp_path / "run", tmp_path / "weights.pt", tmp_path / "ready"
    first = _srun(["--pause-at", "5", "--ready", str(ready), *_example_args(kind, work, out)], bin_dir)
    _wait_for_files([ready / "ready_0", ready / "ready_1"], first, "the first run")
    for proc in first:
        proc.send_signal(signal.SIGTERM)
    wait_all(first, TIMEOUT, "the preempted loop")
    assert [p.name for p in sorted((work / "checkpoints").iterdir())] == ["checkpoint_0"]
    assert not (bin_dir / "scontrol.log").exists()
    assert not out.exists()
    wait_all(_srun(_example_args(kind, work, out), bin_dir, SLURM_RESTART_COUNT="1"), TIMEOUT, "the rerun")
    _assert_same_weights(out, weights)
