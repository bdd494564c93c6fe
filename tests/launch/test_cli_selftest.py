"""``lightning-accel test`` and ``launch -q`` end to end, as subprocesses (``python -m lightning_accel.cli``).

``test`` on an FSDP2 config trains on 2 CPU processes (gloo) and compares the gathered weights with plain PyTorch's;
a config the launcher refuses makes it fail with status 1. ``launch -q`` leaves out the launcher's failure summary.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_accel.cli import main
from tests.helpers import ACCELERATE_CONFIGS, clean_env, run_python

FIXTURES = ACCELERATE_CONFIGS
CLI = ["-m", "lightning_accel.cli"]


def _run(tmp_path: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = clean_env(HF_HOME=str(tmp_path / "hf"))
    return subprocess.run([sys.executable, *CLI, *argv], env=env, capture_output=True, text=True, timeout=timeout)


def test_test_command_trains_an_fsdp_config_to_plain_pytorchs_weights(tmp_path: Path) -> None:
    proc = run_python(
        [*CLI, "test", "--config_file", str(FIXTURES / "fsdp2_cpu.yaml")], timeout=400, HF_HOME=str(tmp_path / "hf")
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ok: ")]
    assert lines == [
        "ok: 2 process(es), FSDP, on cpu",
        "ok: 25 samples sharded over the processes and gathered back once, in order",
        "ok: 4 training steps give plain PyTorch's weights (within 1e-05)",
    ]
    assert proc.stdout.rstrip().endswith("Test is a success! You are ready for your distributed training!")


def test_test_command_fails_when_the_launch_fails(tmp_path: Path) -> None:
    config = yaml.safe_load((FIXTURES / "multi_cpu.yaml").read_text()) | {"num_machines": 2, "num_processes": 4}
    (tmp_path / "two_machines.yaml").write_text(yaml.safe_dump(config))
    proc = _run(tmp_path, "test", "--config_file", str(tmp_path / "two_machines.yaml"))
    assert proc.returncode == 1, proc.stderr
    assert "2 machines need main_process_ip" in proc.stderr  # the launcher's reason
    assert "The self-check failed (exit status 2)" in proc.stdout and "success" not in proc.stdout


def test_test_command_needs_an_existing_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", "--config_file", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml' does not exist" in capsys.readouterr().err


def test_launch_quiet_leaves_out_the_failure_summary(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text('raise SystemExit("the worker failed here")\n')
    summaries = {}
    for flags in ([], ["-q"]):
        proc = _run(tmp_path, "launch", *flags, "--cpu", "--num_processes", "1", str(script))
        assert proc.returncode == 1
        assert "the worker failed here" in proc.stderr  # the worker's own output stays
        summaries[bool(flags)] = "Root Cause (first observed failure)" in proc.stderr
    assert summaries == {False: True, True: False}
