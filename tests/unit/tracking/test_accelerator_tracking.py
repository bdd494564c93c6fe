"""Accelerator trackers: TensorBoard, real wandb (offline) and MLflow (file store) runs read back from their files,
the same values as under HF accelerate, "all", registered and custom GeneralTrackers, main-process-only, errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.enums import DistributedType
from lightning_accel.state import PartialState, reset_state
from lightning_accel.tracking import (
    LOGGER_TYPE_TO_CLASS,
    CometMLTracker,
    GeneralTracker,
    MLflowTracker,
    WandBTracker,
    filter_trackers,
    get_available_trackers,
    on_main_process,
    register_tracker_class,
    resolve_trackers,
)
from tests.helpers import SCRIPTS, free_port, reset_accelerator_states, run_python
from tests.scripts import tracking_parity
from tests.tracking_readers import comet_offline_experiment, mlflow_runs, wandb_offline_run


def _tracker_env(root: Path) -> dict[str, str]:
    """wandb offline and MLflow on a file store, everything under ``root``."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(root),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # mlflow 3 wants a database otherwise (not in mlflow-skinny)
    }


@pytest.fixture(autouse=True)
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    _wandb_teardown()  # an earlier test file may have left wandb set up for its own folders
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _tracker_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    yield tmp_path
    _wandb_teardown()


def _wandb_teardown() -> None:
    """Forget wandb's process-wide settings (it reads ``WANDB_DIR`` once per process otherwise)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()


class Recorder(GeneralTracker):
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self) -> None:
        self.calls.append(("start", None))

    @property
    def tracker(self) -> Any:
        return self.calls

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.calls.append(("config", dict(values)))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", (dict(values), step, kwargs)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def test_tensorboard_writes_scalars_text_and_groups(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("proj", config={"lr": 0.1, "epochs": 2})
    accelerator.log({"loss": 0.5, "acc": torch.tensor(0.75)}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello", "group": {"a": 1.0, "b": 2.0}}, step=2)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert type(writer).__name__ == "SummaryWriter"
    accelerator.end_training()
    assert accelerator.trackers == [accelerator.get_tracker("tensorboard")]  # kept after end_training, as Accelerate
    events = EventAccumulator(str(tmp_path / "proj"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in events.Scalars("acc")] == [0.75]


def test_custom_tracker_receives_every_call(tmp_path: Path) -> None:
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    accelerator.init_trackers("proj", config={"lr": 0.1})
    accelerator.log({"loss": 1.0}, step=3, log_kwargs={"recorder": {"commit": True}})
    assert accelerator.get_tracker("recorder") is recorder
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    accelerator.end_training()
    assert recorder.calls == [
        ("start", None),
        ("config", {"lr": 0.1}),
        ("log", ({"loss": 1.0}, 3, {"commit": True})),
        ("finish", None),
    ]


def test_tracker_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="project_dir"):  # at construction, as Accelerate
        Accelerator(cpu=True, log_with="tensorboard")
    reset_state()
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("proj")
    with pytest.raises(TypeError, match="loss=list"):
        accelerator.log({"loss": [1.0]})
    with pytest.raises(ValueError, match="wandb"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()


# ---- wandb ---------------------------------------------------------------------------------------------------------


def test_wandb_offline_run_records_project_config_and_steps(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with="wandb")
    accelerator.init_trackers("proj", config={"lr": 0.1, "epochs": 2}, init_kwargs={"wandb": {"name": "first"}})
    run = accelerator.get_tracker("wandb", unwrap=True)
    assert type(run).__name__ == "Run"
    assert run.project == "proj"
    accelerator.log({"loss": 0.5, "acc": torch.tensor(0.75)}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello"}, step=3, log_kwargs={"wandb": {"commit": True}})
    tracker = accelerator.get_tracker("wandb")
    assert isinstance(tracker, WandBTracker)
    tracker.log_table("preds", columns=["x", "y"], data=[[1, 2], [3, 4]], step=4)
    accelerator.end_training()
    _wandb_teardown()  # wandb-core closes the run file when its service stops; read once it has (CI read it short)

    found = wandb_offline_run(tmp_path)
    assert (found["project"], found["name"]) == ("proj", "first")
    assert found["config"] == {"lr": 0.1, "epochs": 2}
    history = found["history"]
    assert history[0] == {"_step": 1, "loss": 0.5, "acc": 0.75}
    assert history[1] == {"_step": 3, "loss": 0.25, "note": "hello"}
    assert (history[2]["_step"], history[2]["preds/_type"]) == (4, "table-file")
    table = json.loads((found["dir"] / "files" / history[2]["preds/path"]).read_text())
    assert (table["columns"], table["data"]) == (["x", "y"], [[1, 2], [3, 4]])


def test_wandb_project_comes_from_init_trackers() -> None:
    accelerator = Accelerator(cpu=True, log_with="wandb")
    with pytest.raises(ValueError, match="project_name"):
        accelerator.init_trackers("proj", init_kwargs={"wandb": {"project": "other"}})


# ---- mlflow --------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("undo_library_side_effects")
def test_mlflow_file_store_run_records_params_metrics_and_tags(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers(
        "exp", config={"lr": 0.1, "epochs": 2}, init_kwargs={"mlflow": {"run_name": "r1", "tags": {"team": "a"}}}
    )
    accelerator.log({"loss": 0.5, "acc": torch.tensor(0.75)}, step=1)
    with pytest.warns(UserWarning, match="note=str is dropped"):
        accelerator.log({"loss": 0.25, "note": "hello"}, step=2)
    artifact = tmp_path / "notes.txt"
    artifact.write_text("hi")
    accelerator.get_tracker("mlflow").log_artifact(str(artifact))
    assert accelerator.get_tracker("mlflow", unwrap=True).info.run_name == "r1"
    accelerator.end_training()

    (run,) = mlflow_runs((tmp_path / "mlruns").as_uri(), "exp")
    assert (run["name"], run["status"]) == ("r1", "FINISHED")
    assert run["params"] == {"lr": "0.1", "epochs": "2"}
    assert run["tags"]["team"] == "a"
    assert run["metrics"] == {"loss": [(1, 0.5), (2, 0.25)], "acc": [(1, 0.75)]}
    assert (Path(run["artifact_uri"].removeprefix("file://")) / "notes.txt").read_text() == "hi"


def test_mlflow_environment_wins_and_experiment_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"source": "env"}')
    for run_name in ("a", "b"):
        tracker = MLflowTracker("ignored", run_name=run_name, tags={"source": "argument"})
        tracker.start()
        tracker.log({"loss": 1.0})
        tracker.finish()
    runs = mlflow_runs((tmp_path / "mlruns").as_uri(), "from-env")
    assert sorted(run["name"] for run in runs) == ["a", "b"]
    assert {run["tags"]["source"] for run in runs} == {"env"}
    assert all(run["metrics"] == {"loss": [(0, 1.0)]} for run in runs)
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "maybe")
    with pytest.raises(ValueError, match="MLFLOW_NESTED_RUN"):
        MLflowTracker("exp")


# ---- same values as HF accelerate; main process only -----------------------------------------------------------------


_PARITY_HISTORY = [{"_step": 1, "loss": 0.5, "acc": 0.75}, {"_step": 2, "loss": 0.125, "note": "hello"}]


def _parity_records(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return wandb_offline_run(root), mlflow_runs((root / "mlruns").as_uri(), "parity")


def _run_in_process(framework: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _tracker_env(root).items():
        monkeypatch.setenv(name, value)
    try:
        tracking_parity.run(framework)
    finally:
        _wandb_teardown()
        reset_accelerator_states()


def test_same_wandb_and_mlflow_records_as_hf_accelerate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_in_process("ours", tmp_path / "ours", monkeypatch)
    _run_in_process("hf", tmp_path / "hf", monkeypatch)
    (ours_wandb, (ours_run,)), (hf_wandb, (hf_run,)) = (
        _parity_records(tmp_path / "ours"),
        _parity_records(tmp_path / "hf"),
    )
    assert (ours_wandb["project"], ours_wandb["name"], hf_wandb["project"], hf_wandb["name"]) == (
        "parity",
        "ours",
        "parity",
        "hf",
    )
    assert ours_wandb["config"] == hf_wandb["config"] == {"lr": 0.1, "epochs": 2, "optimizer": "sgd"}
    assert ours_wandb["history"] == hf_wandb["history"] == _PARITY_HISTORY
    assert ours_run["params"] == hf_run["params"] == {"lr": "0.1", "epochs": "2", "optimizer": "sgd"}
    assert ours_run["metrics"] == hf_run["metrics"] == {"loss": [(1, 0.5), (2, 0.25), (0, 0.125)], "acc": [(1, 0.75)]}


@pytest.mark.launch
def test_only_the_main_process_creates_runs(tmp_path: Path) -> None:
    # The script also checks that no process imports wandb/mlflow before init_trackers, nor ever on rank 1.
    launch = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]
    run_python([*launch, str(SCRIPTS / "tracking_parity.py"), "ours"], timeout=240, **_tracker_env(tmp_path))
    wandb_run, mlflow_run = _parity_records(tmp_path)  # each reader asserts a single run
    assert wandb_run["history"] == _PARITY_HISTORY
    assert len(mlflow_run) == 1


def test_other_processes_start_and_log_nothing(tmp_path: Path) -> None:
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder, "tensorboard"], project_dir=str(tmp_path))
    PartialState()._configure(
        DistributedType.MULTI_CPU, torch.device("cpu"), num_processes=2, process_index=1, local_index=1
    )
    accelerator.init_trackers("proj", config={"lr": 0.1})
    accelerator.log({"loss": 1.0})
    assert accelerator.trackers == [] and recorder.calls == []
    assert type(accelerator.get_tracker("tensorboard")) is GeneralTracker  # a no-op stand-in
    assert not (tmp_path / "proj").exists()


class MainOnly(GeneralTracker):
    name = "main_only"

    def __init__(self, everywhere: bool) -> None:
        self.main_process_only = not everywhere
        self.logged: list[Mapping[str, Any]] = []

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append(values)


def test_on_main_process_follows_main_process_only() -> None:
    PartialState()._configure(
        DistributedType.MULTI_CPU, torch.device("cpu"), num_processes=2, process_index=1, local_index=1
    )
    main_only, everywhere = MainOnly(everywhere=False), MainOnly(everywhere=True)
    main_only.log({"a": 1})
    everywhere.log({"a": 1})
    assert (main_only.logged, everywhere.logged) == ([], [{"a": 1}])
    assert WandBTracker.main_process_only is False and MLflowTracker.main_process_only is True  # as Accelerate


# ---- "all", registration, errors -----------------------------------------------------------------------------------


def test_all_selects_every_installed_tracker_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accelerate's order; aim, clearml, dvclive, swanlab and trackio too where installed (the test extra has them).
    installed = get_available_trackers()
    assert installed[:3] == ["tensorboard", "wandb", "comet_ml"] and "mlflow" in installed
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=["wandb", "all", recorder, "tensorboard"])
    assert accelerator.log_with == ["wandb", "tensorboard", *installed[2:], recorder]
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert resolve_trackers("all") == [name for name in installed if name != "wandb"]


def test_all_needs_a_logging_dir_for_tensorboard(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with="all")
    with pytest.raises(ValueError, match=r"Logging with `tensorboard`(, `aim`)? requires a `logging_dir`"):
        accelerator.init_trackers("proj")
    with pytest.raises(ValueError, match="project_dir"):
        filter_trackers(["all"], logging_dir=None)
    assert filter_trackers(["all"], logging_dir=str(tmp_path)) == get_available_trackers()


def test_no_tracker_is_a_no_op() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0})
    assert accelerator.trackers == []


class Registered(Recorder):
    name = "registered"
    requires_logging_directory = True

    def __init__(self, project_name: str, logging_dir: str, flag: bool = False) -> None:
        super().__init__()
        self.args = (project_name, logging_dir, flag)


def test_registered_tracker_is_built_by_name(tmp_path: Path) -> None:
    register_tracker_class(Registered)
    try:
        accelerator = Accelerator(cpu=True, log_with="registered", project_dir=str(tmp_path))
        accelerator.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"registered": {"flag": True}})
        tracker = accelerator.get_tracker("registered")
        assert tracker.args == ("proj", str(tmp_path), True)
        assert tracker.calls == [("start", None), ("config", {"lr": 0.1})]
        accelerator.end_training()
    finally:
        del LOGGER_TYPE_TO_CLASS["registered"]
    with pytest.raises(ValueError, match="GeneralTracker subclass"):
        register_tracker_class(dict)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="'registered' now selects"):
        register_tracker_class(Registered)
        register_tracker_class(Registered)
    del LOGGER_TYPE_TO_CLASS["registered"]


@pytest.mark.parametrize(
    ("log_with", "match"),
    [
        (
            "neptune",
            r"Unknown tracker 'neptune'; use one of \['aim', 'clearml', 'comet_ml', 'dvclive', 'mlflow', 'swanlab',"
            r" 'tensorboard', 'trackio', 'wandb'\]",
        ),
        ("nope", "Unknown tracker 'nope'"),
        (["tensorboard", 3], "Unknown tracker 3"),
    ],
)
def test_bad_trackers(log_with: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Accelerator(cpu=True, log_with=log_with)


@pytest.mark.parametrize(
    ("name", "install"),
    [
        ("wandb", r"pip install 'lightning-accel\[wandb\]'"),
        ("mlflow", "pip install mlflow"),
        ("comet_ml", "pip install comet_ml"),
    ],
)
def test_missing_package_names_the_install_command(name: str, install: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=f"log_with='{name}' needs its package: {install}"):
        Accelerator(cpu=True, log_with=name)
    tracker = {"wandb": WandBTracker, "mlflow": MLflowTracker, "comet_ml": CometMLTracker}[name]("proj")
    with pytest.raises(ImportError, match=install):
        tracker.start()


@pytest.mark.launch
def test_comet_offline_experiment_matches_hf_accelerate(tmp_path: Path) -> None:
    run_python([str(SCRIPTS / "tracking_comet.py"), str(tmp_path)], timeout=240, COMET_DISABLE_AUTO_LOGGING="1")
    ours, hf = comet_offline_experiment(tmp_path / "ours"), comet_offline_experiment(tmp_path / "hf")
    assert ours["project"] == hf["project"] == "parity"
    assert ours["params"] == hf["params"]
    assert {"lr": 0.1, "epochs": 2, "optimizer": "sgd"}.items() <= ours["params"].items()
    assert (
        ours["metrics"]
        == hf["metrics"]
        == {
            "loss": [(1, 0.5), (2, 0.25)],
            "acc": [(1, 0.75)],
            "a": [(2, 1.0)],
            "b": [(2, 2.0)],
        }
    )
    assert (ours["other"]["note"], ours["other"]["Name"], hf["other"]["note"]) == ("hello", "ours", "hello")


def test_a_named_file_tracker_without_a_directory_raises_at_construction_as_hf() -> None:
    import accelerate

    import lightning_accel

    for library in (accelerate, lightning_accel):
        reset_accelerator_states()
        with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
            library.Accelerator(cpu=True, log_with="tensorboard")
    reset_accelerator_states()
