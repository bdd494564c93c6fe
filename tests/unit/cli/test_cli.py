"""The ``lightning-accel`` command in-process (``env``, ``config``, ``trainer-args``) and launch planning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from lightning_accel.cli import launch_settings, main
from lightning_accel.cli.launch import plan_launch
from lightning_accel.config import load_config
from lightning_accel.enums import DistributedType
from tests.helpers import ACCELERATE_CONFIGS, REPO, clean_env

FIXTURES = ACCELERATE_CONFIGS


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No default config of this machine, and relative DeepSpeed JSON paths resolve in the fixtures."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(FIXTURES)


def _launch_plan(*argv: str) -> tuple[list[str], dict[str, str]]:
    from lightning_accel.cli import _build_parser

    args = _build_parser().parse_args(["launch", *argv])
    plan = plan_launch(launch_settings(args), [args.training_script, *args.training_script_args])
    return list(plan.torchrun_args), plan.env


def test_console_script_is_declared_and_points_at_main() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]\n", 1)[1].split("\n\n", 1)[0]
    assert scripts == 'lightning-accel = "lightning_accel.cli:main"'
    assert callable(main)


@pytest.mark.launch
def test_cli_modules_import_no_heavy_optional_packages() -> None:
    code = (
        "import sys, lightning_accel.cli, lightning_accel.cli.launch, lightning_accel.utils.environment,"
        " lightning_accel.utils.launch;"
        "heavy = [m for m in ('deepspeed', 'wandb', 'torchao', 'transformer_engine') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=clean_env(), timeout=120)


def test_env_prints_versions_devices_backends_and_the_default_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "lightning_accel: 0.1.0" in out and "torch: " in out and "lightning: " in out
    assert "Collective backends: gloo" in out
    assert "Default config: none" in out
    assert main(["config", "--default", "--mixed_precision", "bf16"]) == 0
    assert main(["env"]) == 0
    assert "mixed_precision: bf16" in capsys.readouterr().out


def test_config_default_writes_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "basic.yaml"
    assert main(["config", "--default", "--mixed_precision", "fp16", "--config_file", str(target)]) == 0
    assert json.loads(target.read_text())["mixed_precision"] == "fp16"
    assert main(["config", "--default", "--config_file", str(target)]) == 1
    assert "already exists" in capsys.readouterr().out
    assert main(["config"]) == 2
    assert "only `lightning-accel config --default` is implemented" in capsys.readouterr().err


def test_trainer_args_explains_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trainer-args", "--config_file", "fsdp2_cpu.yaml", "--launch_env"]) == 0
    out = capsys.readouterr().out
    assert "accelerator='cpu'," in out and "devices=2," in out and "precision='32-true'," in out
    assert "strategy=AcceleratedFSDPStrategy(...)  # 'acc_fsdp'" in out
    assert "fsdp_plugin: FullyShardedDataParallelPlugin" in out and "fsdp_version = 2" in out
    assert "FSDP_AUTO_WRAP_POLICY=SIZE_BASED_WRAP" in out
    assert main(["trainer-args", "--config_file", "deepspeed_file.yaml"]) == 0
    out = capsys.readouterr().out
    assert "deepspeed_plugin: DeepSpeedPlugin" in out and "zero_stage = 3" in out and "stage: 3" in out


def test_trainer_args_reports_files_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trainer-args", "--config_file", "megatron.yaml"]) == 2
    assert "cannot run MegatronLMPlugin(context_parallel_size=2): context parallelism" in capsys.readouterr().err
    assert main(["trainer-args", "--config_file", "missing.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_launch_plan_for_one_machine_lets_torchrun_pick_the_port() -> None:
    args, env = _launch_plan("--config_file", "multi_cpu.yaml", "train.py", "--lr", "0.1")
    assert args == ["--nnodes", "1", "--nproc_per_node", "2", "--standalone", "train.py", "--lr", "0.1"]
    assert env["ACCELERATE_USE_CPU"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert env["OMP_NUM_THREADS"] == "1" and env["KMP_BLOCKTIME"] == "1"
    args, _ = _launch_plan("--config_file", "multi_cpu.yaml", "--main_process_port", "29600", "train.py")
    assert args[4:8] == ["--master_addr", "127.0.0.1", "--master_port", "29600"]


def test_launch_plan_for_several_machines() -> None:
    with mock.patch("lightning_accel.cli.launch._local_device_count", return_value=8):  # an 8-GPU machine
        args, env = _launch_plan("--config_file", "multi_node.yaml", "--machine_rank", "0", "train.py")
    assert args == [
        "--nnodes", "2", "--nproc_per_node", "8", "--node_rank", "0", "--rdzv_backend", "c10d",
        "--rdzv_conf", "join_timeout=600", "--rdzv_endpoint", "10.0.0.1:29555", "train.py",
    ]  # fmt: skip
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and "CUDA_VISIBLE_DEVICES" not in env
    args, _ = _launch_plan(
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "127.0.0.1",
        "--main_process_port", "29501", "--same_network", "train.py",
    )  # fmt: skip
    assert args == [
        "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", "1", "--rdzv_backend", "static",
        "--rdzv_conf", "timeout=600", "--master_addr", "127.0.0.1", "--master_port", "29501", "train.py",
    ]  # fmt: skip


def test_command_line_wins_over_the_file() -> None:
    from lightning_accel.cli import _build_parser

    argv = ["launch", "--config_file", "fsdp2_cpu.yaml", "--mixed_precision", "bf16", "--fsdp_version", "1", "t.py"]
    settings = launch_settings(_build_parser().parse_args(argv))
    assert (settings["mixed_precision"], settings["fsdp_version"]) == ("bf16", 1)
    with mock.patch("lightning_accel.cli.launch._local_device_count", return_value=4):  # a 4-GPU machine
        _, env = _launch_plan("--config_file", "multi_gpu.yaml", "--gpu_ids", "2,3", "--num_processes", "2", "t.py")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    _, env = _launch_plan("--config_file", "multi_cpu.yaml", "--use_fsdp", "--fsdp_offload_params", "yes", "t.py")
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_OFFLOAD_PARAMS"]) == ("true", "true")
    on_cpu = launch_settings(_build_parser().parse_args(["launch", "--config_file", "multi_gpu.yaml", "--cpu", "t.py"]))
    assert (on_cpu["distributed_type"], on_cpu["use_cpu"]) == (DistributedType.MULTI_CPU, True)


def test_launch_without_a_config_file_runs_one_process_per_machine_on_cpu() -> None:
    from lightning_accel.cli import _build_parser

    settings = launch_settings(_build_parser().parse_args(["launch", "--num_processes", "2", "t.py"]))
    assert (settings["distributed_type"], settings["num_machines"]) == (DistributedType.MULTI_CPU, 1)
    assert launch_settings(_build_parser().parse_args(["launch", "t.py"]))["distributed_type"] == DistributedType.NO


def test_launch_uses_the_default_config_file(tmp_path: Path) -> None:
    from lightning_accel.cli import _build_parser

    load_config("dynamo.yaml").save(tmp_path / "hf" / "accelerate" / "default_config.yaml")
    settings = launch_settings(_build_parser().parse_args(["launch", "t.py"]))
    assert (settings["distributed_type"], settings["dynamo_backend"]) == (DistributedType.MULTI_CPU, "INDUCTOR")


LAUNCH_ERRORS = {
    "megatron": (["--config_file", "megatron.yaml"], r"cannot run MegatronLMPlugin\(context_parallel_size=2\)"),
    "mpirun": (["--config_file", "mpirun.yaml"], "mpirun_hostfile is set"),
    "no address": (["--num_machines", "2"], "2 machines need main_process_ip"),
    "rank": (["--num_machines", "2", "--machine_rank", "2"], "machine_rank must be below num_machines"),
    "unknown count": (["--config_file", "fsdp2_cpu.yaml", "--num_processes", "-1"], "num_processes is -1"),
    "two types": (["--use_fsdp", "--use_deepspeed"], "choose one distributed type"),
    "bad value": (["--mixed_precision", "fp4"], r"--mixed_precision must be one of"),
    "pdsh": (
        ["--config_file", "deepspeed_inline.yaml", "--num_machines", "2", "--deepspeed_multinode_launcher", "pdsh"],
        "deepspeed_multinode_launcher is 'pdsh'",
    ),
}


@pytest.mark.parametrize(("argv", "match"), LAUNCH_ERRORS.values(), ids=LAUNCH_ERRORS.keys())
def test_launch_refuses_before_starting_anything(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-accel launch: error: ")
    assert re.search(match, err), err


@pytest.mark.launch
def test_launch_runs_a_failing_script_and_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys; print('rank', os.environ['RANK'], os.environ['ACCELERATE_USE_CPU']); sys.exit(3)\n"
    )
    with mock.patch.dict(os.environ):  # the launcher exports the plan's variables for torch.distributed.run
        assert main(["launch", "--cpu", "--num_processes", "2", str(script)]) == 1
    assert "exitcode  : 3" in capsys.readouterr().err
