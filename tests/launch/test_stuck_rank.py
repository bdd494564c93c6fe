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


@pytest.mark.parametrize("mode", ["trainer", "accelerator"])
def test_a_stuck_rank_ends_with_the_job_within_the_timeout(tmp_path: Path, mode: str) -> None:
    job = subprocess.Popen(
        _command(mode, tmp_path), env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    assert job.returncode != 0, output[-3000:]
    stuck_at = float((tmp_path / "stuck_1").read_text())
    stuck_pid = int((tmp_path / "pid_1").read_text())
    deadline = stuck_at + TIMEOUT_S + SLACK_S
    while _alive(stuck_pid) and time.time() < deadline + 30:
        time.sleep(0.2)
    ended = time.time()
    if _alive(stuck_pid):
        os.kill(stuck_pid, 9)
        pytest.fail(
            f"rank 1 (pid {stuck_pid}) still runs {ended - stuck_at:.0f} s after it got stuck:\n{output[-3000:]}"
        )
    assert ended <= deadline, f"rank 1 ended {ended - stuck_at:.1f} s after it got stuck\n{output[-3000:]}"
    if mode == "trainer":
        assert "the launching process (local rank 0, pid" in output
        assert "so local rank 1" in output and "ends too instead of waiting for it" in output
