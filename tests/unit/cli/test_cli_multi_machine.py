"""Multi-machine launch planning (issue 32): ``--multi_gpu`` on a CPU machine, the rendezvous timeout and its error.

The launches themselves (two local machines beside HF accelerate's launcher, a machine that never arrives) are in
``tests/launch/test_multi_machine.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from lightning_accel.cli import _build_parser, _plan, main
from lightning_accel.cli.launch import DEFAULT_RDZV_TIMEOUT_S, LaunchPlan
from lightning_accel.config import load_config
from lightning_accel.launch_settings.rendezvous import Meeting, wait_for_machines
from tests.helpers import free_port

TWO_MACHINES = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")


@pytest.fixture(autouse=True)
def _no_default_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)


def _launch(*argv: str) -> LaunchPlan:
    return _plan(_build_parser().parse_args(["launch", *argv, "train.py"]))


def _conf(plan: LaunchPlan) -> str:
    args = list(plan.torchrun_args)
    return args[args.index("--rdzv_conf") + 1]


@no_cuda
def test_multi_gpu_without_gpus_plans_a_cpu_group_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _launch("--multi_gpu", *TWO_MACHINES, "29500")
    assert plan.torchrun_args[:4] == ("--nnodes", "2", "--nproc_per_node", "1")  # one CPU process per machine
    assert plan.env["ACCELERATE_USE_CPU"] == "true" and "CUDA_VISIBLE_DEVICES" not in plan.env
    err = capsys.readouterr().err
    assert err.startswith("lightning-accel launch: warning: distributed_type MULTI_GPU (--multi_gpu)")
    assert "training on CPU as MULTI_CPU" in err and "Pass --cpu" in err
    assert _launch("--cpu", *TWO_MACHINES, "29500").env == plan.env  # the fix it names: the same plan, silently
    assert capsys.readouterr().err == ""


def test_rendezvous_timeout_from_the_flag_the_file_or_the_default(tmp_path: Path) -> None:
    assert _conf(_launch("--cpu", *TWO_MACHINES, "29500")) == f"timeout={DEFAULT_RDZV_TIMEOUT_S}"
    assert _conf(_launch("--cpu", *TWO_MACHINES, "29500", "--rdzv_timeout", "30")) == "timeout=30"
    file = tmp_path / "two.yaml"
    file.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 2\nmachine_rank: 1\n"
        "main_process_ip: 10.0.0.1\nmain_process_port: 29500\nrdzv_timeout: 45\n"
    )
    assert load_config(file).rdzv_timeout == 45
    assert _conf(_launch("--config_file", str(file))) == "timeout=45"
    assert _conf(_launch("--config_file", str(file), "--rdzv_timeout", "9")) == "timeout=9"  # the flag wins
    # accelerate launch's spelling is honoured, other rendezvous options kept; c10d reads join_timeout.
    assert _conf(_launch("--cpu", *TWO_MACHINES, "29500", "--rdzv_conf", "timeout=20,read_timeout=7")) == (
        "timeout=20,read_timeout=7"
    )
    c10d = _launch("--cpu", *TWO_MACHINES, "29500", "--rdzv_backend", "c10d", "--rdzv_timeout", "30")
    assert _conf(c10d) == "join_timeout=30"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv_timeout", "0"], "--rdzv_timeout must be an integer >= 1, got 0"),
        (["--rdzv_timeout", "5s"], "--rdzv_timeout must be an integer, got '5s'"),
        (["--rdzv_timeout", "5", "--rdzv_conf", "timeout=9"], "--rdzv_conf sets timeout=9 and rdzv_timeout is 5"),
        (["--rdzv_conf", "timeout"], "--rdzv_conf must be key=value pairs separated by commas, got 'timeout'"),
    ],
)
def test_bad_rendezvous_timeouts_are_refused_naming_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--cpu", *TWO_MACHINES, "29500", *argv, "train.py"]) == 2
    assert f"lightning-accel launch: error: {message}" in capsys.readouterr().err


def test_a_file_with_a_bad_rdzv_timeout_is_refused_naming_file_and_key(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nrdzv_timeout: soon\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: rdzv_timeout must be an integer, got 'soon'"):
        load_config(file)


def test_waiting_machines_name_the_missing_ranks_and_the_address(caplog: pytest.LogCaptureFixture) -> None:
    """Machines 0 and 2 of 3 arrive; machine 1 never does: the wait ends at the deadline naming it."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    store.set("arrived_machine_2", "1")
    meeting = Meeting(0, 3, "127.0.0.1", port, timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as caught:
        wait_for_machines(store, meeting, deadline=start + 1.0)
    assert time.monotonic() - start < 3
    assert str(caught.value).startswith(
        f"machine_rank 0: only 2 of 3 machines arrived at the rendezvous on 127.0.0.1:{port} within rdzv_timeout 1 s;"
        " missing machine_rank(s): 1. Start `lightning-accel launch --num_machines 3 --machine_rank R"
    )
    store.set("arrived_machine_1", "1")
    wait_for_machines(store, meeting, deadline=time.monotonic() + 1.0)  # everyone here: returns at once


def test_a_machine_that_cannot_reach_the_main_one_says_so() -> None:
    message = str(Meeting(1, 2, "10.0.0.1", 29500, timedelta(seconds=600)).timed_out([0], unseen=True))
    assert message.startswith(
        "machine_rank 1: only 1 of 2 machines (this one) arrived at the rendezvous on 10.0.0.1:29500 within "
        "rdzv_timeout 600 s; missing machine_rank(s): 0 (the main machine"
    )
    assert "raise --rdzv_timeout" in message and "reachable" in message
