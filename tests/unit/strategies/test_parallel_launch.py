"""ND parallelism from config files and ``lightning-accel launch --use_parallelism_config`` (``acc_parallel``).

The end-to-end test launches a config file with a ``parallelism_config`` section on 2 CPU processes (gloo) and trains
``L.Trainer(**trainer_kwargs())`` with tp=2, against the same model on one process. The others check, without
processes, what the file, the command line and the launch environment become, against HF accelerate 1.15's launcher
and its ``ParallelismConfig`` reading the same variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

from lightning_accel import trainer_kwargs
from lightning_accel.cli import _build_parser, launch_settings
from lightning_accel.cli.launch import plan_launch
from lightning_accel.config import load_config
from lightning_accel.strategies import AcceleratedParallelStrategy, FabricAcceleratedParallelStrategy
from lightning_accel.strategies.from_settings import strategy_from_env
from lightning_accel.utils.environment import accelerator_kwargs, env_from_settings, parallelism_config_from_env
from tests.helpers import ACCELERATE_CONFIGS, SCRIPTS, run_python

FIXTURES = ACCELERATE_CONFIGS
ATOL = 1e-5
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "cp_backend", "sp_backend")


def write_config(tmp_path: Path, **content: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", **content}))
    return path


def sizes(config: Any) -> tuple[Any, ...]:
    return tuple(getattr(config, name) for name in SIZES)


@pytest.mark.launch
def test_launch_trains_tensor_parallel_from_a_config_file_like_one_process(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        distributed_type="MULTI_CPU",
        use_cpu=True,
        num_processes=2,
        parallelism_config={"parallelism_config_tp_size": 2},
    )
    out = tmp_path / "out"
    command = ["-m", "lightning_accel.cli", "launch", "--config_file", str(config)]
    run_python([*command, str(SCRIPTS / "launch_parallel.py"), "--out", str(out)], timeout=300, HF_HOME=str(tmp_path))
    results = [torch.load(out / f"launch_rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["strategy_class"] == "AcceleratedParallelStrategy"
        assert result["trainer_kwargs"] == {"accelerator": "cpu", "devices": 2, "num_nodes": 1, "precision": "32-true"}
        assert result["sizes"] == (1, 1, 1, 2)
        assert result["variables"]["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        assert result["variables"]["PARALLELISM_CONFIG_TP_SIZE"] == "2"
        assert result["mesh_dims"] == ("tp",) and result["placements"] == ["S(0)"]
        assert result["ranks"]["tp"] == rank
        reference = result["reference"]
        assert len(result["losses"]) == len(reference["losses"]) == 16
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert result["weights"].keys() == reference["weights"].keys()
        for key, value in result["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=0, atol=ATOL, msg=f"rank {rank} {key}")


def accelerate_env(argv: list[str]) -> dict[str, str]:
    """The variables HF accelerate's launcher adds for ``--use_parallelism_config``."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    return dict(prepare_extend_env_parallelism_config(launch_command_parser().parse_args([*argv, "train.py"]), {}))


def ours(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, str]]:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no_default_config"))
    settings = launch_settings(_build_parser().parse_args(["launch", *argv, "train.py"]))
    env = plan_launch(settings, ["train.py"]).env
    return settings, {name: value for name, value in env.items() if "PARALLELISM" in name}


@pytest.mark.parametrize(
    "sizes_argv",
    [
        ["--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"],
        ["--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_size", "2"],
        ["--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2"],
    ],
    ids=["dp_shard_tp", "dp_shard_cp", "hsdp"],
)
def test_command_line_passes_the_variables_accelerate_launch_passes(
    sizes_argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsdp = ["--use_fsdp", "--fsdp_version", "2", "--use_parallelism_config"]
    settings, env = ours(["--cpu", *fsdp, *sizes_argv], tmp_path, monkeypatch)
    assert env == accelerate_env([*fsdp, *sizes_argv])
    assert settings["num_processes"] == 4  # the sizes' product, when no file or option gives the count


def test_command_line_without_use_fsdp_trains_acc_parallel_with_fsdp2_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--use_parallelism_config", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
    _, env = ours(["--cpu", *argv], tmp_path, monkeypatch)
    assert env == accelerate_env(argv)
    strategy = trainer_kwargs(environ={**env, "ACCELERATE_USE_CPU": "true", "WORLD_SIZE": "4"})["strategy"]
    assert isinstance(strategy, AcceleratedParallelStrategy)
    assert sizes(strategy._parallel.config) == (1, 2, 2, 1, 1, "torch", "deepspeed")
    assert strategy._parallel.checkpoints.version == 2


def test_command_line_sizes_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--config_file", str(FIXTURES / "parallelism.yaml"), "--cpu", "--parallelism_config_dp_shard_size", "4"]
    argv += ["--parallelism_config_tp_size", "1"]
    _, env = ours(argv, tmp_path, monkeypatch)
    assert (env["PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["PARALLELISM_CONFIG_TP_SIZE"]) == ("4", "1")


def test_sizes_without_use_parallelism_config_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"--parallelism_config_tp_size given without --use_parallelism_config"):
        ours(["--cpu", "--num_processes", "2", "--parallelism_config_tp_size", "2"], tmp_path, monkeypatch)


def test_fsdp_file_gives_acc_parallel_its_fsdp_section(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        distributed_type="FSDP",
        use_cpu=True,
        num_processes=4,
        fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_state_dict_type": "FULL_STATE_DICT"},
        parallelism_config={"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2},
    )
    config = load_config(path)
    kwargs = trainer_kwargs(config=path, environ={})
    strategy = kwargs["strategy"]
    assert isinstance(strategy, AcceleratedParallelStrategy)
    assert (kwargs["accelerator"], kwargs["devices"]) == ("cpu", 4)
    assert sizes(strategy._parallel.config) == sizes(config.build_parallelism_config())
    plugin = strategy._parallel.checkpoints.plugin
    assert (plugin.fsdp_version, plugin.reshard_after_forward, plugin.state_dict_type) == (2, False, "FULL_STATE_DICT")
    assert strategy._save_distributed_checkpoint is False  # FULL_STATE_DICT: one file
    fabric_strategy = strategy_from_env(fabric=True, config=path, environ={})
    assert isinstance(fabric_strategy, FabricAcceleratedParallelStrategy)
    assert L.Trainer(**trainer_kwargs(config=path, environ={}), logger=False).strategy.world_size == 4


def test_launch_environment_round_trips_and_matches_accelerates_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.parallelism_config import ParallelismConfig as HFParallelismConfig

    config = load_config(FIXTURES / "parallelism.yaml")
    env = env_from_settings(config.settings())
    assert env["ACCELERATE_USE_FSDP"] == env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    read = parallelism_config_from_env(env)
    assert read is not None and sizes(read) == sizes(config.build_parallelism_config())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert sizes(read) == sizes(HFParallelismConfig())  # HF reads the same variables into the same sizes
    assert accelerator_kwargs(environ={**env, "WORLD_SIZE": "4"})["parallelism_config"] == read


def test_flag_alone_is_an_all_ones_config_and_the_variables_need_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.parallelism_config import ParallelismConfig as HFParallelismConfig

    for name in ("PARALLELISM_CONFIG_TP_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    alone = parallelism_config_from_env({"ACCELERATE_USE_PARALLELISM_CONFIG": "true"})
    assert alone is not None and sizes(alone) == sizes(HFParallelismConfig())
    assert parallelism_config_from_env({"PARALLELISM_CONFIG_TP_SIZE": "2"}) is None
    assert parallelism_config_from_env({"ACCELERATE_USE_PARALLELISM_CONFIG": "false"}) is None
    with pytest.raises(ValueError, match=r"PARALLELISM_CONFIG_TP_SIZE must be an integer, got 'two'"):
        parallelism_config_from_env({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "two"})
    # under a launch that names no type, the flag alone replicates over the processes with acc_parallel
    strategy = trainer_kwargs(environ={"ACCELERATE_USE_PARALLELISM_CONFIG": "true"})["strategy"]
    assert isinstance(strategy, AcceleratedParallelStrategy)


REFUSED = {
    "fsdp1": (
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}},
        {"parallelism_config_dp_shard_size": 2},
        r"fsdp_version is 1; set fsdp_config.fsdp_version: 2",
    ),
    "fsdp_without_shard_dim": (
        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
        {"parallelism_config_tp_size": 2},
        r"no dimension for FSDP to shard across",
    ),
    "deepspeed": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}},
        {"parallelism_config_dp_shard_size": 2},
        r"not with distributed_type DEEPSPEED",
    ),
    "process_count": (
        {"distributed_type": "MULTI_CPU", "num_processes": 4},
        {"parallelism_config_tp_size": 2},
        r"multiplies to 2 processes .* but num_processes is 4",
    ),
    "sequence_parallel": (
        {"distributed_type": "MULTI_CPU"},
        {"parallelism_config_sp_size": 2},
        r"parallelism_config_sp_size is 2, but DeepSpeed sequence parallelism",
    ),
}


@pytest.mark.parametrize(("top", "section", "match"), REFUSED.values(), ids=REFUSED.keys())
def test_contradicting_files_are_refused_with_the_fix(
    top: dict[str, Any], section: dict[str, Any], match: str, tmp_path: Path
) -> None:
    path = write_config(tmp_path, **{"use_cpu": True, "num_processes": 2, **top, "parallelism_config": section})
    with pytest.raises(ValueError, match=match):
        trainer_kwargs(config=path, environ={})
