"""Accelerator trackers: TensorBoard through Lightning's logger, custom GeneralTracker subclasses, errors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.state import reset_state
from lightning_accel.tracking import GeneralTracker


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    reset_state()
    yield
    reset_state()


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
    assert accelerator.trackers == []
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


def test_all_selects_the_installed_trackers_and_no_tracker_is_a_no_op(tmp_path: Path) -> None:
    assert Accelerator(cpu=True, log_with="all").log_with == ["tensorboard"]
    reset_state()
    accelerator = Accelerator(cpu=True)
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0})
    assert accelerator.trackers == []


@pytest.mark.parametrize(
    ("log_with", "match"),
    [("wandb", "'wandb' is not supported"), ("nope", "Unknown tracker"), (["tensorboard", 3], "Unknown tracker 3")],
)
def test_bad_trackers(log_with: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Accelerator(cpu=True, log_with=log_with)


def test_tracker_errors(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with="tensorboard")
    with pytest.raises(ValueError, match="project_dir"):
        accelerator.init_trackers("proj")
    reset_state()
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("proj")
    with pytest.raises(TypeError, match="loss=list"):
        accelerator.log({"loss": [1.0]})
    with pytest.raises(ValueError, match="wandb"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()
