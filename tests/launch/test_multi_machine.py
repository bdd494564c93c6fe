"""Two "machines" on one host (issue 32): two launcher processes, machine_rank 0 and 1, on 127.0.0.1 and a free port.

HF accelerate's ``accelerate launch --multi_gpu`` on a machine without GPUs starts the same torchrun processes, and
a script with ``Accelerator(cpu=True)`` trains there as one gloo group: the reference for the final weights, which
``lightning-accel launch --multi_gpu`` (a warning, then ``MULTI_CPU``) and a ``MULTI_CPU`` config file give bit for
bit with a plain ``Accelerator()``. A machine that never arrives ends both launchers after ``--rdzv_timeout``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import SCRIPTS, clean_env, free_port, wait_all

SCRIPT = str(SCRIPTS / "multi_machine_parity.py")
TIMEOUT = 180
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch of a machine without GPUs")


def _machine_flags(rank: int, port: int) -> list[str]:
    return ["--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]


def _start(module: str, argv: list[str], hf_home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        env=clean_env(HF_HOME=str(hf_home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _two_machines(module: str, argv_for: Any, out: Path, script_args: list[str]) -> list[str]:
    """Start machines 0 and 1 (``argv_for(rank, port)`` is each one's launcher options); their outputs."""
    port = free_port()
    machines = [
        _start(module, [*argv_for(rank, port), SCRIPT, *script_args, "--out", str(out)], out.parent / "hf")
        for rank in (0, 1)
    ]
    return wait_all(machines, TIMEOUT, f"{module} on two machines")


def _results(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def _assert_same_weights(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["weights"].keys() == reference["weights"].keys()
        for name, tensor in mine["weights"].items():
            assert torch.equal(tensor, reference["weights"][name]), name  # bit for bit


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """``accelerate launch --multi_gpu --num_processes 2 --num_machines 2`` with ``Accelerator(cpu=True)``."""
    out = tmp_path_factory.mktemp("hf") / "out"
    flags = ["launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "2"]
    _two_machines(
        "accelerate.commands.accelerate_cli",
        lambda rank, port: [*flags, *_machine_flags(rank, port)],
        out,
        ["--library", "hf", "--cpu"],
    )
    results = _results(out)
    assert [r["facts"] for r in results] == [
        {"num_processes": 2, "distributed_type": "MULTI_CPU", "backend": "gloo", "world_size": 2}
    ] * 2
    return results


def test_multi_gpu_on_cpu_machines_trains_as_hf_accelerate(hf_results: list[dict[str, Any]], tmp_path: Path) -> None:
    out = tmp_path / "out"
    outputs = _two_machines(
        "lightning_accel.cli",
        lambda rank, port: ["launch", "--multi_gpu", "--num_machines", "2", *_machine_flags(rank, port)],
        out,
        ["--library", "ours"],
    )
    for output in outputs:
        assert "lightning-accel launch: warning: distributed_type MULTI_GPU (--multi_gpu)" in output
        assert "training on CPU as MULTI_CPU" in output
    ours = _results(out)
    assert [r["facts"] for r in ours] == [r["facts"] for r in hf_results]
    _assert_same_weights(ours, hf_results)


def test_a_multi_cpu_config_file_per_machine_trains_as_hf_accelerate(
    hf_results: list[dict[str, Any]], tmp_path: Path
) -> None:
    def config_file(rank: int, port: int) -> list[str]:
        path = tmp_path / f"machine{rank}.yaml"
        path.write_text(
            f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 2\n"
            f"machine_rank: {rank}\nmain_process_ip: 127.0.0.1\nmain_process_port: {port}\nrdzv_timeout: 60\n"
        )
        return ["launch", "--config_file", str(path)]

    out = tmp_path / "out"
    outputs = _two_machines("lightning_accel.cli", config_file, out, ["--library", "ours"])
    assert not any("warning: distributed_type" in output for output in outputs)
    _assert_same_weights(_results(out), hf_results)


def test_a_machine_that_never_arrives_ends_each_launch_naming_it(tmp_path: Path) -> None:
    """Machine 0 alone (machine 1 never starts), and machine 1 alone (no machine 0): both exit with the reason."""
    ports = {0: free_port(), 1: free_port()}
    start = time.monotonic()
    script = [SCRIPT, "--library", "ours", "--out", str(tmp_path / "out")]
    flags = ["launch", "--cpu", "--num_machines", "2", "--rdzv_timeout", "3"]
    alone = {
        rank: _start("lightning_accel.cli", [*flags, *_machine_flags(rank, ports[rank]), *script], tmp_path / "hf")
        for rank in (0, 1)
    }
    outputs = {rank: proc.communicate(timeout=TIMEOUT)[0] for rank, proc in alone.items()}
    assert time.monotonic() - start < 60  # the 3 s timeout plus start-up, not torch's 600 s
    assert [alone[rank].returncode for rank in (0, 1)] == [1, 1], outputs
    assert (
        "lightning-accel launch: error: machine_rank 0: only 1 of 2 machines arrived at the rendezvous on "
        f"127.0.0.1:{ports[0]} within rdzv_timeout 3 s; missing machine_rank(s): 1."
    ) in outputs[0]
    assert (
        "lightning-accel launch: error: machine_rank 1: only 1 of 2 machines (this one) arrived at the rendezvous on "
        f"127.0.0.1:{ports[1]} within rdzv_timeout 3 s; missing machine_rank(s): 0 (the main machine"
    ) in outputs[1]
    for output in outputs.values():
        assert "Traceback" not in output and "frame #" not in output
    assert not (tmp_path / "out").exists()  # no worker started
