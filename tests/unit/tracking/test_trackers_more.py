"""Aim, ClearML, DVCLive, SwanLab and Trackio: one offline run per tracker through HF accelerate and through
lightning_accel (tests/scripts/tracking_more.py, in one process), read back from each package's own files.

Each test skips when its package is missing; CI installs them all (the ``test`` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.tracking import (
    LOGGER_TYPE_TO_CLASS,
    AimTracker,
    ClearMLTracker,
    DVCLiveTracker,
    SwanLabTracker,
    TrackioTracker,
    get_available_trackers,
    resolve_trackers,
)
from lightning_accel.tracking.clearml import title_and_series
from tests.helpers import SCRIPTS, run_python
from tests.tracking_readers import (
    aim_run,
    clearml_offline_task,
    dvclive_records,
    swanlab_offline_run,
    trackio_run,
)

NEW = ("aim", "clearml", "dvclive", "swanlab", "trackio")
CONFIG = {"lr": 0.1, "epochs": 2, "optimizer": "sgd"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the script logged one run per installed tracker, HF's and ours."""
    installed = [name for name in NEW if name in get_available_trackers()]
    if not installed:
        pytest.skip("none of aim, clearml, dvclive, swanlab, trackio is installed")
    root = tmp_path_factory.mktemp("trackers")
    env = {
        "CLEARML_OFFLINE_MODE": "1",
        "CLEARML_CACHE_DIR": str(root / "clearml-cache"),
        "TRACKIO_DIR": str(root / "trackio"),
        "DVC_NO_ANALYTICS": "1",
        "HOME": str(root / "home"),  # ClearML and SwanLab keep session files there
    }
    run_python([str(SCRIPTS / "tracking_more.py"), str(root), *installed], timeout=600, **env)
    return root


@pytest.mark.launch
def test_aim_repository_holds_the_same_run_as_hf(runs: Path) -> None:
    pytest.importorskip("aim")
    ours, hf = (aim_run(runs / "aim" / framework, image_names=("img",)) for framework in ("ours", "hf"))
    assert ours == hf
    assert ours == {
        "name": "parity",
        "hparams": CONFIG,
        "metrics": {"loss": [(1, 0.5), (2, 0.25)], "acc": [(1, 0.75)]},
        "images": {"img": [(1, "ramp", (4, 4))]},
    }


@pytest.mark.launch
def test_clearml_offline_session_matches_hf(runs: Path) -> None:
    pytest.importorskip("clearml")
    ours, hf = (clearml_offline_task(Path((runs / "clearml" / name).read_text())) for name in ("ours", "hf"))
    assert (ours.pop("name"), hf.pop("name")) == ("ours", "hf")
    assert ours == hf
    assert ours["project"] == "parity"
    assert dict(ours["config"]) == CONFIG
    assert ours["scalars"] == {("loss", "train"): [(1, 0.5), (2, 0.25)], ("acc", "eval"): [(1, 0.75)]}  # note dropped
    assert ours["single"] == {"final": 0.125}
    assert ours["tables"] == {("preds", "train"): (3, ["x", "y"], [[1, 3], [2, 4]])}
    assert ours["images"] == [("img", "eval", 1)]


@pytest.mark.launch
def test_dvclive_files_match_hf(runs: Path) -> None:
    pytest.importorskip("dvclive")
    ours, hf = (dvclive_records(runs / "dvclive" / name) for name in ("ours", "hf"))
    assert ours == hf
    assert ours == {
        "params": CONFIG,
        "summary": {"loss": 0.125, "acc": 0.75, "step": 5},
        "history": {"loss": [(1, 0.5), (2, 0.25), (5, 0.125)], "acc": [(1, 0.75)]},  # no step: the next one
    }


@pytest.mark.launch
def test_swanlab_offline_run_matches_hf(runs: Path) -> None:
    pytest.importorskip("swanlab")
    ours, hf = (swanlab_offline_run(runs / "swanlab" / name) for name in ("ours", "hf"))
    assert (ours.pop("name"), hf.pop("name")) == ("ours", "hf")
    # Known differences: the FRAMEWORK entry names the framework; Accelerate's allow_val_change=True becomes an entry.
    assert (ours["config"].pop("FRAMEWORK"), hf["config"].pop("FRAMEWORK")) == ("lightning_accel", "🤗Accelerate")
    hf["config"].pop("allow_val_change", None)
    assert ours == hf
    assert ours == {
        "project": "parity",
        "config": CONFIG,
        "scalars": {"loss": [(1, 0.5), (2, 0.25)], "acc": [(1, 0.75)]},
        "media": {"img": [(3, 1)]},
        "state": "RUN_STATE_FINISHED",
    }


@pytest.mark.launch
def test_trackio_database_matches_hf(runs: Path) -> None:
    pytest.importorskip("trackio")
    ours, hf = (trackio_run(runs / "trackio", "parity", name) for name in ("ours", "hf"))
    assert hf["config"].pop("allow_val_change") is True  # Accelerate's keyword lands in Trackio's plain-dict config
    assert ours == hf
    assert ours == {
        "config": CONFIG,
        "rows": [{"step": 1, "loss": 0.5, "acc": 0.75}, {"step": 2, "loss": 0.25, "note": "hello"}],
    }


def test_dvclive_in_process_takes_tensors_and_strings_and_drops_the_rest(tmp_path: Path) -> None:
    pytest.importorskip("dvclive")
    accelerator = Accelerator(cpu=True, log_with="dvclive")
    live = {"dir": str(tmp_path / "live"), "save_dvc_exp": False, "dvcyaml": None}
    accelerator.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"dvclive": live})
    with pytest.warns(UserWarning, match="DVCLive cannot log bad=list as a metric: dropped"):
        accelerator.log({"loss": torch.tensor(0.5), "note": "hi", "bad": [1, 2]}, step=2)
    accelerator.log({"loss": 0.25})
    accelerator.end_training()
    assert accelerator.get_tracker("dvclive", unwrap=True) is accelerator.trackers[0].live  # kept, as Accelerate
    assert dvclive_records(tmp_path / "live") == {
        "params": {"lr": 0.1},
        "summary": {"loss": 0.25, "note": "hi", "step": 3},
        "history": {"loss": [(2, 0.5), (3, 0.25)], "note": [(2, "hi")]},
    }


# ---- selection, signatures, errors (no package needed) ---------------------------------------------------------------


def test_all_picks_the_nine_trackers_when_installed() -> None:
    for module in NEW:
        pytest.importorskip(module)
    expected = ["tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio"]
    assert resolve_trackers("all") == expected  # Accelerate's order
    import accelerate.tracking

    assert [str(name) for name in accelerate.tracking.get_available_trackers()] == expected


def test_new_trackers_are_built_by_name_as_in_accelerate(tmp_path: Path) -> None:
    import accelerate.tracking as hf_tracking

    for name, cls in (
        ("aim", AimTracker),
        ("clearml", ClearMLTracker),
        ("dvclive", DVCLiveTracker),
        ("swanlab", SwanLabTracker),
        ("trackio", TrackioTracker),
    ):
        theirs = hf_tracking.LOGGER_TYPE_TO_CLASS[name]
        assert LOGGER_TYPE_TO_CLASS[name] is cls
        assert (cls.name, cls.requires_logging_directory, cls.main_process_only) == (
            theirs.name,
            theirs.requires_logging_directory,
            theirs.main_process_only,
        )


def test_constructing_imports_nothing_and_start_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    trackers: list[tuple[Any, str]] = [
        (AimTracker("proj", "logs"), "pip install 'aim<4'"),
        (ClearMLTracker(), "pip install clearml"),
        (DVCLiveTracker(), "pip install dvclive"),
        (SwanLabTracker("proj"), "pip install swanlab"),
        (TrackioTracker("proj"), "pip install trackio"),
    ]
    for module in NEW:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    for tracker, install in trackers:
        with pytest.raises(ImportError, match=f"needs the '{tracker.name}' package: {install}"):
            tracker.start()
        with pytest.raises(ImportError, match=f"log_with='{tracker.name}' needs its package: {install}"):
            Accelerator(cpu=True, log_with=tracker.name)


def test_aim_repo_keyword_wins_over_the_logging_dir() -> None:
    tracker = AimTracker("proj", "logs", repo="elsewhere", experiment="exp")
    assert (tracker.aim_repo_path, tracker.init_kwargs) == ("elsewhere", {"experiment": "exp"})


def test_clearml_titles_and_tables() -> None:
    assert [title_and_series(key) for key in ("eval_loss", "test_acc", "train_lr", "loss", "evaluation")] == [
        ("loss", "eval"),
        ("acc", "test"),
        ("lr", "train"),
        ("loss", "train"),
        ("evaluation", "train"),
    ]
    with pytest.raises(ValueError, match=r"log_table\('preds'\) needs `data`"):
        ClearMLTracker("proj").log_table("preds", columns=["x"])
