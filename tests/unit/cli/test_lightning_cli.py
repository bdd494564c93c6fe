"""``LightningCLI`` with ``--trainer.strategy acc_fsdp`` and lightning_accel's callbacks given by ``class_path``.

The 2-process runs are real CLI subprocesses (``tests/scripts/lightning_cli.py fit`` then ``validate``): the config file
gives the callbacks as ``class_path``/``init_args``, the command line the strategy and ``CheckpointRotation`` (with
``--trainer.callbacks+=``). The in-process tests check that jsonargparse reads the strategies' and plugins' signatures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from tests.helpers import SCRIPTS, run_python

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the test extra installs it)")

MAX_STEPS = 8
EVERY = 2  # optimizer steps between checkpoints
TOTAL_LIMIT = 2


def write_config(tmp_path: Path, metrics: Path) -> Path:
    config = {
        "seed_everything": 42,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": MAX_STEPS,
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path / "root"),
            "callbacks": [
                {"class_path": "lightning_accel.callbacks.GradientAccumulation", "init_args": {"num_steps": 2}},
                {"class_path": "lightning_accel.callbacks.SeedableSampler", "init_args": {"data_seed": 7}},
                {"class_path": "tests.scripts.lightning_cli.RecordValidation", "init_args": {"path": str(metrics)}},
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(*args: str) -> None:
    run_python([str(SCRIPTS / "lightning_cli.py"), *args], timeout=240)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fit`` on 2 CPU processes under acc_fsdp (FSDP2), then ``validate`` from the newest rotated checkpoint."""
    tmp_path = tmp_path_factory.mktemp("lightning_cli")
    metrics = tmp_path / "metrics.jsonl"
    config = write_config(tmp_path, metrics)
    project = tmp_path / "run"
    cli(
        "fit",
        f"--config={config}",
        "--trainer.strategy=acc_fsdp",
        "--trainer.callbacks+=lightning_accel.callbacks.CheckpointRotation",
        f"--trainer.callbacks.project_config.project_dir={project}",
        "--trainer.callbacks.project_config.automatic_checkpoint_naming=true",
        f"--trainer.callbacks.project_config.total_limit={TOTAL_LIMIT}",
        f"--trainer.callbacks.every_n_train_steps={EVERY}",
    )
    checkpoints = sorted(p.name for p in (project / "checkpoints").iterdir())
    saved_config = yaml.safe_load((tmp_path / "root" / "config.yaml").read_text())  # validate overwrites it
    newest = project / "checkpoints" / f"checkpoint_{MAX_STEPS // EVERY - 1}"
    cli("validate", f"--config={config}", "--trainer.strategy=acc_fsdp", f"--ckpt_path={newest}")
    return {
        "checkpoints": checkpoints,
        "newest": newest,
        "saved_config": saved_config,
        "records": [json.loads(line) for line in metrics.read_text().splitlines()],
    }


@pytest.mark.launch
def test_rotation_kept_the_newest_checkpoints(fitted: dict[str, Any]) -> None:
    # 4 saves (steps 2, 4, 6, 8) are checkpoint_0 .. checkpoint_3; total_limit=2 keeps the last two
    assert fitted["checkpoints"] == ["checkpoint_2", "checkpoint_3"]
    # acc_fsdp's default (sharded state dict): a torch.distributed.checkpoint directory with meta.pt
    names = {p.name for p in fitted["newest"].iterdir()}
    assert {".metadata", "meta.pt"} <= names
    assert sum(name.endswith(".distcp") for name in names) == 2


@pytest.mark.launch
def test_fit_ran_to_max_steps_with_the_cli_callbacks(fitted: dict[str, Any]) -> None:
    fit = [r for r in fitted["records"] if r["fn"] == "fit"]
    # GradientAccumulation(num_steps=2): 4 micro-batches per epoch and process make 2 optimizer steps per epoch
    assert [r["global_step"] for r in fit] == [2, 4, 6, 8]
    assert fit[-1]["val_loss"] < fit[0]["val_loss"]
    saved = fitted["saved_config"]["trainer"]
    assert saved["strategy"] == "acc_fsdp"
    assert [c["class_path"] for c in saved["callbacks"]] == [
        "lightning_accel.callbacks.GradientAccumulation",
        "lightning_accel.callbacks.SeedableSampler",
        "tests.scripts.lightning_cli.RecordValidation",
        "lightning_accel.callbacks.CheckpointRotation",
    ]


@pytest.mark.launch
def test_validate_from_the_rotated_checkpoint_gives_the_fitted_model(fitted: dict[str, Any]) -> None:
    fit = [r for r in fitted["records"] if r["fn"] == "fit"]
    validate = [r for r in fitted["records"] if r["fn"] == "validate"]
    assert len(validate) == 1
    # the last validation of fit ran on the weights saved at step 8
    assert validate[0]["val_loss"] == pytest.approx(fit[-1]["val_loss"], abs=1e-6)


def parse(*args: str) -> Any:
    """The Trainer LightningCLI builds from ``args`` (nothing runs)."""
    from lightning.pytorch.cli import LightningCLI

    from tests.scripts.entry_points import Classifier

    base = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"]
    with mock.patch.object(sys, "argv", ["lightning_cli.py"]):  # LightningCLI warns about pytest's own arguments
        return LightningCLI(Classifier, run=False, args=[*base, *args]).trainer


@pytest.mark.usefixtures("undo_library_side_effects")
def test_strategy_and_plugin_by_class_path(tmp_path: Path) -> None:
    fsdp = {
        "class_path": "lightning_accel.strategies.AcceleratedFSDPStrategy",
        "init_args": {"fsdp_plugin": {"fsdp_version": 1, "state_dict_type": "FULL_STATE_DICT"}},
    }
    config = tmp_path / "fsdp1.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": fsdp}}))
    strategy = parse(f"--config={config}").strategy
    assert type(strategy).__name__ == "AcceleratedFSDPStrategy"
    assert (strategy.fsdp_plugin.fsdp_version, strategy.fsdp_plugin.state_dict_type) == (1, "FULL_STATE_DICT")


@pytest.mark.usefixtures("undo_library_side_effects")
def test_deepspeed_plugin_by_class_path() -> None:
    strategy = parse(
        "--trainer.strategy.class_path=lightning_accel.strategies.deepspeed.AcceleratedDeepSpeedStrategy",
        "--trainer.strategy.init_args.deepspeed_plugin.zero_stage=3",
        "--trainer.strategy.init_args.load_full_weights=true",  # a keyword of its **kwargs: Unpack[...]
    ).strategy
    assert type(strategy).__name__ == "AcceleratedDeepSpeedStrategy"
    assert strategy.deepspeed_plugin.zero_stage == 3
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.load_full_weights is True


@pytest.mark.usefixtures("undo_library_side_effects")
def test_a_misspelled_strategy_keyword_is_refused_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(
            "--trainer.strategy.class_path=lightning_accel.strategies.AcceleratedFSDPStrategy",
            "--trainer.strategy.init_args.load_full_weights=true",
        )
    assert "load_full_weights" in capsys.readouterr().err


@pytest.mark.usefixtures("undo_library_side_effects")
def test_callbacks_by_class_path_on_the_command_line(tmp_path: Path) -> None:
    trainer = parse(
        "--trainer.strategy=acc_fsdp",
        "--trainer.callbacks+=lightning_accel.callbacks.CheckpointRotation",
        f"--trainer.callbacks.project_config.project_dir={tmp_path}",
        "--trainer.callbacks.project_config.automatic_checkpoint_naming=true",
        "--trainer.callbacks.project_config.total_limit=3",
        "--trainer.callbacks.every_n_train_steps=5",
        "--trainer.callbacks+=lightning_accel.callbacks.GradientAccumulation",
        "--trainer.callbacks.num_steps=4",
    )
    from lightning_accel.callbacks import CheckpointRotation, GradientAccumulation

    (rotation,) = (c for c in trainer.callbacks if isinstance(c, CheckpointRotation))
    (accumulation,) = (c for c in trainer.callbacks if isinstance(c, GradientAccumulation))
    assert (rotation.project_config.total_limit, rotation.directory) == (3, tmp_path / "checkpoints")
    assert accumulation.num_steps == 4
    assert type(trainer.strategy).__name__ == "AcceleratedFSDPStrategy"
