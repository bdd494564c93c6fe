"""lightning_accel.integrations.ray without a Ray cluster: what prepare_trainer accepts and refuses.

The recipes themselves run on a local Ray cluster in tests/launch/test_ray.py, where every Trainer goes through
prepare_trainer (Ray's own RayDDPStrategy to Ray's function, the acc_* strategies to the checks here): Ray's
environment reads the Ray Train context, so a Trainer with it can only be built inside a worker.
"""

from __future__ import annotations

import sys

import lightning as L
import pytest

from lightning_accel.integrations.ray import prepare_trainer

# Importing Ray's ray.train.lightning sets RAY_CLIENT_MODE.
pytestmark = pytest.mark.usefixtures("undo_library_side_effects")


def _trainer(strategy: object, **options: object) -> L.Trainer:
    return L.Trainer(accelerator="cpu", strategy=strategy, logger=False, enable_checkpointing=False, **options)


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray.train.lightning", None)  # as if Ray Train were not installed
    with pytest.raises(ImportError, match=r"needs Ray Train: `pip install lightning-accel\[ray\]`"):
        prepare_trainer(_trainer("acc_ddp", devices=2))


def test_a_strategy_ray_cannot_run_is_refused() -> None:
    pytest.importorskip("ray.train.lightning")
    with pytest.raises(TypeError, match=r"strategy AcceleratedSingleDeviceStrategy.*one of \[.*'acc_ddp'.*'acc_fsdp'"):
        prepare_trainer(_trainer("acc_no", devices=1))


def test_an_environment_that_is_not_rays_is_refused() -> None:
    pytest.importorskip("ray.train.lightning")
    with pytest.raises(TypeError, match=r"cluster environment is LightningEnvironment.*RayLightningEnvironment\(\)"):
        prepare_trainer(_trainer("acc_ddp", devices=2))


def test_no_trainer_is_refused() -> None:
    with pytest.raises(TypeError, match=r"takes a lightning\.pytorch\.Trainer, got str"):
        prepare_trainer("acc_ddp")  # type: ignore[arg-type]
