"""What Lightning's own strategy tests check, asked of the ``acc_*`` strategies next to Lightning's built-in ones.

Lightning's test suite is not on the package index, so these are our equivalents, unit-level: registry names build
what they say (against Lightning's strategy of the same name), ``PL_DEEPSPEED_CONFIG_PATH`` is read as Lightning
reads it, and the Trainer's and Fabric's connectors hand devices, ``num_nodes``, precision strings and
``sync_batchnorm`` to ``acc_*`` strategies as they do to ``ddp``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_accel  # noqa: F401  # registers the acc_* names
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy
from lightning_accel.strategies.deepspeed_env import LIGHTNING_CONFIG_VARIABLE
from lightning_accel.utils import DeepSpeedPlugin

QUIET: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
DEEPSPEED_NAMES = [
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
]
FILE_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 123, "overlap_comm": False},
}


def zero_settings(config: dict[str, Any]) -> tuple[int, str, str]:
    zero = config["zero_optimization"]

    def device(section: str) -> str:
        return str((zero.get(section) or {}).get("device") or "none")

    return zero["stage"], device("offload_optimizer"), device("offload_param")


# --------------------------------------------------------------------------- registry arguments


@pytest.mark.parametrize("name", DEEPSPEED_NAMES)
def test_deepspeed_names_build_the_zero_settings_of_lightnings_namesake(name: str) -> None:
    lightnings = StrategyRegistry.get(name)  # constructing Lightning's needs no GPU; running it would
    expected = zero_settings(lightnings.config)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=f"acc_{name}", **QUIET)
    assert zero_settings(trainer.strategy.config) == expected
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=f"acc_{name}")
    assert zero_settings(fabric.strategy.config) == expected
    assert zero_settings(FABRIC_REGISTRY.get(name).config) == expected  # Fabric's registry agrees with the Trainer's


def test_registry_descriptions_and_fabric_twins_exist_for_every_acc_name() -> None:
    names = [n for n in StrategyRegistry.available_strategies() if n.startswith("acc_")]
    assert {"acc_ddp", "acc_fsdp", "acc_deepspeed_stage_3_offload"} <= set(names)
    for name in names:
        assert StrategyRegistry[name]["description"], name
        assert name in FABRIC_REGISTRY.available_strategies(), name


# --------------------------------------------------------------------------- PL_DEEPSPEED_CONFIG_PATH


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FILE_CONFIG))
    monkeypatch.setenv(LIGHTNING_CONFIG_VARIABLE, str(path))
    return path


def assert_holds_the_file(config: dict[str, Any]) -> None:
    assert config["zero_optimization"] == FILE_CONFIG["zero_optimization"]
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 1


@pytest.mark.usefixtures("config_file")
def test_the_config_file_variable_is_read_as_lightning_reads_it() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert_holds_the_file(DeepSpeedStrategy().config)  # Lightning's own strategy, for the record
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="acc_deepspeed", **QUIET)
    assert_holds_the_file(trainer.strategy.config)
    assert trainer.strategy.deepspeed_plugin.zero_stage == 3
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="acc_deepspeed")
    assert_holds_the_file(fabric.strategy.config)
    # A name that fixes the same stage takes the file too, as Lightning's deepspeed_stage_3 does.
    assert_holds_the_file(L.Fabric(accelerator="cpu", devices=2, strategy="acc_deepspeed_stage_3").strategy.config)


@pytest.mark.usefixtures("config_file")
def test_an_explicit_plugin_wins_over_the_variable() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert DeepSpeedStrategy(config={"zero_optimization": {"stage": 1}}).config["zero_optimization"]["stage"] == 1
    strategy = AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=1))
    assert strategy.config["zero_optimization"]["stage"] == 1


@pytest.mark.usefixtures("config_file")
def test_a_name_whose_stage_the_file_contradicts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'acc_deepspeed_stage_2' runs with zero_stage=2, but .* gives zero_stage=3"):
        L.Fabric(accelerator="cpu", devices=2, strategy="acc_deepspeed_stage_2")


def test_a_variable_naming_no_file_is_refused_like_lightning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.strategies import DeepSpeedStrategy

    monkeypatch.setenv(LIGHTNING_CONFIG_VARIABLE, str(tmp_path / "absent.json"))
    with pytest.raises(FileNotFoundError, match="path does not exist"):
        DeepSpeedStrategy()
    with pytest.raises(FileNotFoundError, match=r"PL_DEEPSPEED_CONFIG_PATH='.*absent\.json' names no file"):
        L.Trainer(accelerator="cpu", devices=2, strategy="acc_deepspeed", **QUIET)


# --------------------------------------------------------------------------- connector: devices and nodes


@pytest.mark.parametrize("name", ["acc_ddp", "acc_fsdp", "acc_deepspeed"])
def test_devices_and_num_nodes_reach_the_strategy_as_for_ddp(name: str) -> None:
    for devices, num_nodes in ((2, 1), (2, 3), (1, 2)):
        ours = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=name, **QUIET).strategy
        ddp = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", **QUIET).strategy
        assert ours.parallel_devices == ddp.parallel_devices
        assert (ours.num_nodes, ours.num_processes, ours.world_size) == (
            ddp.num_nodes,
            ddp.num_processes,
            ddp.world_size,
        )
        fabric = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=name).strategy
        fabric_ddp = L.Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp").strategy
        assert (fabric.parallel_devices, fabric.num_nodes, fabric.world_size) == (
            fabric_ddp.parallel_devices,
            fabric_ddp.num_nodes,
            fabric_ddp.world_size,
        )


def test_sync_batchnorm_is_applied_as_for_ddp() -> None:
    ours = L.Trainer(accelerator="cpu", devices=2, strategy="acc_ddp", sync_batchnorm=True, **QUIET).strategy
    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, **QUIET).strategy
    ours_sync, ddp_sync = ours._layer_sync, ddp._layer_sync  # type: ignore[attr-defined]
    assert type(ours_sync) is type(ddp_sync) and ddp_sync is not None
    converted = ours_sync.apply(nn.Sequential(nn.BatchNorm1d(3)))
    assert isinstance(converted[0], nn.SyncBatchNorm)


# --------------------------------------------------------------------------- connector: precision strings


def precision_behaviour(plugin: Any) -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype after ``convert_module``, dtype of a matmul inside ``forward_context``) on CPU."""
    module = plugin.convert_module(nn.Linear(4, 4))
    with plugin.forward_context():
        out = torch.mm(torch.ones(2, 4), torch.ones(4, 2))
    return module.weight.dtype, out.dtype


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true", "64-true"])
@pytest.mark.parametrize("name", ["acc_ddp", "acc_fsdp"])
def test_precision_strings_behave_as_under_ddp(name: str, precision: str) -> None:
    makers: tuple[type, ...] = (L.Trainer, L.Fabric)
    if name == "acc_fsdp" and precision == "64-true":
        # Fabric takes acc_fsdp for an FSDPStrategy (litgpt's checks need that) and so builds Lightning's
        # FSDPPrecision, which refuses "64-true" as it does for Lightning's own FSDP; a plugin instance still works.
        with pytest.raises(ValueError, match="`precision='64-true'\\)` is not supported in FSDP"):
            L.Fabric(accelerator="cpu", devices=2, strategy=name, precision=precision)
        from lightning.fabric.plugins import DoublePrecision

        plugin = L.Fabric(accelerator="cpu", devices=2, strategy=name, plugins=[DoublePrecision()]).strategy.precision
        assert precision_behaviour(plugin) == (torch.float64, torch.float64)
        makers = (L.Trainer,)
    for make in makers:
        kwargs = QUIET if make is L.Trainer else {}
        ours = make(accelerator="cpu", devices=2, strategy=name, precision=precision, **kwargs).strategy
        ddp = make(accelerator="cpu", devices=2, strategy="ddp", precision=precision, **kwargs).strategy
        plugin = "precision_plugin" if make is L.Trainer else "precision"
        assert precision_behaviour(getattr(ours, plugin)) == precision_behaviour(getattr(ddp, plugin)), make


# --------------------------------------------------------------------------- connector: launch environments


TORCHELASTIC = {
    "TORCHELASTIC_RUN_ID": "1",
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29555",
}


def ranks(strategy: Any) -> tuple[Any, ...]:
    (getattr(strategy, "set_world_ranks", None) or strategy._set_world_ranks)()  # Fabric's is private
    environment = strategy.cluster_environment
    return (
        type(environment).__name__,
        strategy.global_rank,
        strategy.local_rank,
        strategy.node_rank,
        strategy.world_size,
    )


@pytest.mark.parametrize("name", ["acc_ddp", "acc_fsdp", "acc_deepspeed"])
def test_a_torchelastic_launch_sets_the_ranks_as_for_ddp(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHELASTIC.items():
        monkeypatch.setenv(key, value)
    ddp = ranks(L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", **QUIET).strategy)
    assert ddp == ("TorchElasticEnvironment", 3, 1, 1, 4)
    assert ranks(L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=name, **QUIET).strategy) == ddp
    assert ranks(L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=name).strategy) == ddp


def test_a_strategy_object_gets_the_connectors_devices_as_ddps_does() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accel.strategies import AcceleratedDDPStrategy

    ours = L.Trainer(accelerator="cpu", devices=3, strategy=AcceleratedDDPStrategy(), **QUIET).strategy
    ddp = L.Trainer(accelerator="cpu", devices=3, strategy=DDPStrategy(), **QUIET).strategy
    assert ours.parallel_devices == ddp.parallel_devices == [torch.device("cpu")] * 3
    assert type(ours.accelerator) is type(ddp.accelerator)
