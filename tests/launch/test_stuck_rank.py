"""A rank that stops answering ends the whole job within the process-group timeout plus a few seconds.

Rank 1 sleeps at step 2 outside any collective; rank 0 waits for it in the next gradient all-reduce and fails on the
timeout (20 s). Under the Trainer, Lightning started rank 1 as a child of rank 0 and watches it, but not the other way
round: with Lightning's own ``ddp`` rank 1 stays behind as an orphan. With ``acc_ddp`` it notices rank 0 has gone,
says so naming both ranks, and ends. Under ``torchrun`` (the ``Accelerator`` loop) the agent ends the other workers
once one fails. Either way every process is gone within the timeout + 10 s of rank 1 getting stuck.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, clean_env, free_port

TIMEOUT_S = 20.0  # also the store connect timeout: rank 1 waited >5 s for rank 0's store on 2 loaded cores
SLACK_S = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of an ended parent counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _command(mode: str, out: Path) -> list[str]:
    script = [str(SCRIPTS / "stuck_rank.py"), "--mode", mode, "--timeout", str(TIMEOUT_S), "--out", str(out)]
    if mode == "trainer":
        return [sys.executable, *script]
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    return [sys.executable, *launcher, f"--master_port={free_port()}", *script]


def _check_ended_in_time(mode: str, output: str, out: Path) -> None:
    stuck_at = float((out / "stuck_1").read_text())
    stuck_pid = int((out / "pid_1").read_text())
    deadline = stuck_at + TIMEOUT_S + SLACK_S
    while _alive(stuck_pid) and time.time() < deadline + 30:
        time.sleep(0.2)
    ended = time.time()
    if _alive(stuck_pid):
        os.kill(stuck_pid, 9)
        pytest.fail(f"{mode}: rank 1 (pid {stuck_pid}) still runs {ended - stuck_at:.0f} s after it got stuck")
    assert ended <= deadline, f"{mode}: rank 1 ended {ended - stuck_at:.1f} s after it got stuck\n{output[-3000:]}"


def test_a_stuck_rank_ends_with_the_job_within_the_timeout(tmp_path: Path) -> None:
    """Both jobs at once (each spends most of its time waiting out the timeout), each checked on its own."""
    modes = ("trainer", "accelerator")
    for mode in modes:
        (tmp_path / mode).mkdir()
    jobs = {
        mode: subprocess.Popen(
            _command(mode, tmp_path / mode),
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for mode in modes
    }
    outputs: dict[str, str] = {}
    try:
        for mode, job in jobs.items():
            outputs[mode] = job.communicate(timeout=240)[0]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
    for mode in modes:
        assert jobs[mode].returncode != 0, (mode, outputs[mode][-3000:])
        _check_ended_in_time(mode, outputs[mode], tmp_path / mode)
    trainer = outputs["trainer"]
    assert "the launching process (local rank 0, pid" in trainer
    assert "so local rank 1" in trainer and "ends too instead of waiting for it" in trainer
