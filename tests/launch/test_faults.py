"""Reliability under faults: one process failing makes every process raise (no hang), saves are atomic.

The 2-process cases run ``tests/scripts/faults_*.py`` under ``torch.distributed.run`` on gloo. A case that hangs
(the others waiting in a collective for the process that raised) fails here by the subprocess timeout, or by the
process group's 30 s timeout inside the script, which raises a different error than the one expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_accel.state.shared_errors import raise_on_every_process, run_where, shareable
from tests import restarts
from tests.helpers import SCRIPTS, clean_env, free_port, run_python

CASE_TIMEOUT = 150


def _torchrun_args(script: str, *args: str) -> list[str]:
    return [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPTS / script),
        *args,
    ]


EXPECTED = {
    "save_model_bad_size": "ValueError: save_model(max_shard_size='10XB')",
    "dispatcher_dataset_error": "ValueError: record 5 is corrupt",
    "init_trackers_bad_kwargs": "TypeError: init_trackers(init_kwargs={'strict': {'no_such_option': 1}})",
    "main_process_first_error": "OSError: the download failed",
    "rotation_manager_error": "PermissionError: cannot delete the old checkpoint",
}


def test_a_failure_on_one_process_raises_on_every_process(tmp_path: Path) -> None:
    """Each failure happens on process 0 only; both processes report its exception, none a timeout.

    The cases run one after the other in one launch (the Accelerator's four, then the Trainer's), which also shows
    that each leaves the processes in step for the next.
    """
    cases = list(EXPECTED)
    args = _torchrun_args("faults_no_hang.py", f"--cases={','.join(cases)}")
    proc = run_python(args, CASE_TIMEOUT, FAULTS_DIR=str(tmp_path))
    for rank in (0, 1):
        results = json.loads((tmp_path / f"results_{rank}.json").read_text())
        for case in cases:
            assert results.get(case, "missing").startswith(EXPECTED[case]), (case, rank, results, proc.stderr[-3000:])


def test_shared_errors_without_a_process_group() -> None:
    """One process: the error is raised as is, the result returned, unpicklable errors become RuntimeError."""
    with pytest.raises(KeyError, match="x"):
        raise_on_every_process(KeyError("x"), "a test")
    raise_on_every_process(None, "a test")
    assert run_where(True, lambda: 3, "a test") == 3
    assert run_where(False, lambda: 3, "a test") is None

    class Local(Exception):  # defined in a function: pickle cannot find it again
        pass

    copy = shareable(Local("lost type"))
    assert type(copy) is RuntimeError
    assert str(copy) == "Local: lost type"
    original = ValueError("kept")
    assert shareable(original) is original


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended (rc {proc.returncode}) before stalling:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.2)


def test_sigkill_during_save_state_leaves_the_previous_state_loadable(tmp_path: Path) -> None:
    """2 processes save checkpoint_0, then are SIGKILLed while writing checkpoint_1; a new run resumes from 0.

    Before atomic saves, ``checkpoint_1`` existed half-written and ``load_state()`` picked it (the newest).
    """
    project, ready = tmp_path / "project", tmp_path / "ready"
    args = [sys.executable, *_torchrun_args("faults_kill_save_state.py", f"--project={project}")]
    proc = subprocess.Popen(
        [*args, "--mode=train", f"--ready={ready}"],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(ready, proc, timeout=120)
    finally:
        for pid_file in project.glob("pid_*"):  # the workers (each in a session of its own), then torchrun
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    (project / "pid_0").unlink()
    (project / "pid_1").unlink()
    checkpoints = project / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".checkpoint_1.incomplete", "checkpoint_0"]
    assert (checkpoints / ".checkpoint_1.incomplete" / "model.safetensors").stat().st_size > 0  # half written

    resumed = run_python(_torchrun_args("faults_kill_save_state.py", f"--project={project}", "--mode=resume"), 150)
    assert resumed.stdout.count("LOADED checkpoint_0 weights equal") == 2, resumed.stdout
    # The resumed run's save removed the interrupted one and rotated checkpoint_0 out (total_limit=1).
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1"]
    assert {p.name for p in (checkpoints / "checkpoint_1").iterdir()} >= {"model.safetensors", "optimizer.bin"}
    assert {p.name for p in (checkpoints / "checkpoint_1").iterdir()} >= {"random_states_0.pkl", "random_states_1.pkl"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights of the restart script's run without a kill."""
    root = tmp_path_factory.mktemp("uninterrupted")
    restarts.run("standalone", root / "project", root / "weights.pt")
    return root / "weights.pt"


@pytest.mark.parametrize("topology", ["fixed_port", "two_nodes"])
def test_a_killed_worker_restarts_and_the_run_ends_bit_identical(
    topology: str, uninterrupted: Path, tmp_path: Path
) -> None:
    """SIGKILL of one worker mid-run: the launcher restarts both, they resume from the newest complete checkpoint.

    ``fixed_port`` and ``two_nodes`` use torch's static rendezvous, whose one store for all attempts made the
    restarted workers hang or fail to connect before lightning_accel gave each restart a fresh store. The third
    topology, ``standalone`` (c10d), restarts the Accelerator loop below.
    """
    output = restarts.run(topology, tmp_path / "project", tmp_path / "weights.pt", kill_at_step=5)
    assert "exitcode: -9" in output  # the kill happened, and the launcher restarted the run
    assert restarts.mismatches(uninterrupted, tmp_path / "weights.pt") == []
    checkpoints = tmp_path / "project" / "checkpoints"
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["checkpoint_4", "checkpoint_5"]


def test_an_accelerator_loop_resumes_after_a_restart_with_load_state_missing_ok(tmp_path: Path) -> None:
    """The shim's restart path: ``load_state(missing_ok=True, resume_position=True)`` starts fresh, then resumes."""
    script = restarts.ACCELERATOR_SCRIPT
    restarts.run("fixed_port", tmp_path / "plain", tmp_path / "plain.pt", script=script)
    output = restarts.run("standalone", tmp_path / "killed", tmp_path / "killed.pt", kill_at_step=5, script=script)
    assert "exitcode: -9" in output
    assert restarts.mismatches(tmp_path / "plain.pt", tmp_path / "killed.pt") == []
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["checkpoint_4", "checkpoint_5"]


@pytest.mark.parametrize("case", ["alone", "late"])
def test_a_sharded_save_state_from_some_processes_fails_in_time_naming_them(tmp_path: Path, case: str) -> None:
    """FSDP's ``save_state`` called by rank 0 only ends within the 5 s timeout with an error that says why.

    ``alone``: rank 0 calls it inside ``if is_main_process`` while rank 1 trains on; ``late``: rank 1 calls it after
    rank 0 gave up. (Under DDP the same call from rank 0 only works: ``tests/launch/test_clients_fixes.py``.)
    """
    args = _torchrun_args("sharded_save_from_one_process.py", f"--case={case}", f"--out={tmp_path}")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *args], env=clean_env(), capture_output=True, text=True, timeout=CASE_TIMEOUT, check=False
    )
    assert proc.returncode == (1 if case == "alone" else 0), proc.stderr[-3000:]
    assert time.monotonic() - start < 60
    ranks = (0,) if case == "alone" else (0, 1)  # alone: rank 1 ends when rank 0's exit breaks its collective
    for rank in ranks:
        waited, outcome = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert float(waited) < 5 + 3, (rank, waited)
        assert outcome.startswith("RuntimeError: save_state is collective here (under DistributedType.FSDP"), outcome
        assert "every process must call it" in outcome and "is_main_process" in outcome
    first = (tmp_path / "rank0.txt").read_text()
    assert "process(es) 1 did not call it within 5 s" in first
    assert not (tmp_path / "checkpoint").exists()
