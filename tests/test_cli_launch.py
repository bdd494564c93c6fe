"""``lightning-accel launch`` end to end: real processes through ``torch.distributed.run`` on CPU (gloo, loopback).

Each test starts the launcher as a subprocess (``python -m lightning_accel.cli``, what the ``lightning-accel`` console
script runs) with ``HF_HOME`` pointing at an empty directory, so no default config of this machine leaks in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lightning_accel
from tests.helpers import SCRIPTS, clean_env, free_port, run_python

FIXTURES = Path(__file__).parent / "fixtures" / "accelerate_configs"
LAUNCH = ["-m", "lightning_accel.cli", "launch"]
TIMEOUT = 240


def _rank_facts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def test_multi_cpu_file_starts_two_processes_for_a_trainer_script(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "multi_cpu.yaml"),
            str(SCRIPTS / "launch_trainer.py"),
            "--out",
            str(out),
            "--trainer",
            "kwargs",
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert [f["global_rank"] for f in facts] == [0, 1]
    for f in facts:
        assert f["world_size"] == 2
        assert f["strategy"] == "AcceleratedDDPStrategy"
        assert f["distributed_type"] == "MULTI_CPU"
        assert f["process_group_backend"] == "gloo"
        assert f["steps"] == 2


def test_multi_cpu_file_runs_an_accelerate_style_script_with_the_command_line_precision(tmp_path: Path) -> None:
    if not hasattr(lightning_accel, "Accelerator"):
        pytest.skip("the lightning_accel.Accelerator shim is not in this checkout")
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "multi_cpu.yaml"),
            "--mixed_precision",
            "bf16",
            str(SCRIPTS / "launch_accelerator.py"),
            "--out",
            str(out),
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert [(f["process_index"], f["local_process_index"]) for f in facts] == [(0, 0), (1, 1)]
    for f in facts:
        assert (f["num_processes"], f["distributed_type"], f["device"]) == (2, "MULTI_CPU", "cpu")
        assert f["mixed_precision"] == "bf16"  # --mixed_precision wins over the file's 'no'
        assert f["steps"] == 4  # 64 samples, batch 8, split over 2 processes


def test_fsdp_file_with_use_cpu_shards_the_model_on_cpu_under_acc_auto(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "fsdp2_cpu.yaml"),
            str(SCRIPTS / "launch_trainer.py"),
            "--out",
            str(out),
            "--trainer",
            "auto",
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert len(facts) == 2
    for f in facts:
        assert f["strategy"] == "AcceleratedFSDPStrategy"
        assert f["distributed_type"] == "FSDP"
        assert f["fsdp_version"] == 2
        assert f["process_group_backend"] == "gloo"
        assert f["dtensor_params"] == 4  # both Linear layers' weight and bias are sharded
    assert sum(f["local_numel"] for f in facts) == facts[0]["full_numel"]  # each rank holds its shard only


def _start_node(rank: int, port: int, out: Path, hf_home: Path) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        *LAUNCH,
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        str(SCRIPTS / "launch_trainer.py"),
        "--out",
        str(out),
    ]
    env = clean_env(HF_HOME=str(hf_home))
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait(nodes: list[subprocess.Popen[str]]) -> list[str]:
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        raise AssertionError("the two launches did not finish in time:\n" + "\n".join(outputs)) from None
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-6000:]
    return outputs


def test_two_machines_on_loopback_form_one_world_and_save_on_each_node(tmp_path: Path) -> None:
    out, port = tmp_path / "out", free_port()
    _wait([_start_node(rank, port, out, tmp_path / "hf") for rank in (0, 1)])

    facts = _rank_facts(out)
    assert [(f["global_rank"], f["node_rank"], f["local_rank"]) for f in facts] == [(0, 0, 0), (1, 1, 0)]
    for f in facts:
        assert f["world_size"] == 2
        assert f["num_nodes"] == 2
        assert f["distributed_type"] == "MULTI_CPU"
    # save_on_each_node=True: local rank 0 of every node writes; False: only global rank 0 does.
    assert sorted(p.name for p in (out / "each_node").iterdir()) == ["node0_rank0.txt", "node1_rank1.txt"]
    assert sorted(p.name for p in (out / "main_only").iterdir()) == ["node0_rank0.txt"]
