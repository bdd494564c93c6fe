"""``AsyncNamingCheckpointIO``: a failed background write is raised by the next call naming the file; what it cannot do.

The write fails on the process's own file size limit (``RLIMIT_FSIZE``, set as
``tests/unit/checkpoint/test_write_errors.py`` sets it). The Trainer and Fabric runs with 2 processes are
``tests/launch/test_async_checkpoint_io.py``.
"""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks import CheckpointRotation
from lightning_accel.checkpoint.background import BackgroundSave
from lightning_accel.config import FullyShardedDataParallelPlugin, ProjectConfiguration
from lightning_accel.strategies import AcceleratedFSDPStrategy, AsyncNamingCheckpointIO, FabricAcceleratedFSDPStrategy
from lightning_accel.utils.other import CheckpointWriteError
from tests.helpers import has_module
from tests.unit.checkpoint.test_write_errors import LIMIT, file_size_limit

SMALL = {"state_dict": {"w": torch.zeros(16)}}
LARGE = {"state_dict": {"w": torch.zeros(16_384)}}  # 64 KiB: past LIMIT


def test_a_failed_background_write_is_raised_by_the_next_save_and_by_teardown_naming_the_file(tmp_path: Path) -> None:
    io = AsyncNamingCheckpointIO()
    io.save_checkpoint(SMALL, tmp_path / "a.ckpt")
    with file_size_limit(LIMIT):
        io.save_checkpoint(LARGE, tmp_path / "b.ckpt")  # returns: the thread meets the limit
        io.remove_checkpoint(tmp_path / "a.ckpt")  # what ModelCheckpoint does next: waits for b.ckpt, which fails
        with pytest.raises(CheckpointWriteError, match=r"Could not write b\.ckpt in the folder") as raised:
            io.save_checkpoint(SMALL, tmp_path / "c.ckpt")
        assert raised.value.errno == errno.EFBIG and raised.value.path == tmp_path / "b.ckpt"
        io.save_checkpoint(LARGE, tmp_path / "d.ckpt")
        with pytest.raises(CheckpointWriteError, match=r"Could not write d\.ckpt"):
            io.teardown()
    # The previous file stays (its removal was dropped with the failed save); nothing half-written is published.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], SMALL["state_dict"]["w"])
    io.save_checkpoint(LARGE, tmp_path / "e.ckpt")  # the limit gone, saves go on
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "e.ckpt")["state_dict"]["w"], LARGE["state_dict"]["w"])


def test_a_save_started_elsewhere_is_held_only_once_the_pending_one_is_done(tmp_path: Path) -> None:
    io = AsyncNamingCheckpointIO()
    io.save_checkpoint(SMALL, tmp_path / "a.ckpt")
    started = BackgroundSave(lambda: None, lambda: None, together=False, what="shards")
    with pytest.raises(RuntimeError, match=r"the save of .*a\.ckpt is pending; wait\(\) first"):
        io.hold(started)
    io.wait()
    io.hold(started)
    io.then(lambda: (tmp_path / "followed").touch())
    io.teardown()
    assert (tmp_path / "followed").exists()


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(128, 128)  # 64 KiB of weights: past LIMIT

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainer_raises_the_failed_background_write_at_the_next_save(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)],
        plugins=[AsyncNamingCheckpointIO()],
    )
    data = DataLoader(TensorDataset(torch.randn(16, 128)), batch_size=4)
    with file_size_limit(LIMIT), pytest.raises(CheckpointWriteError, match=r"Could not write step=1\.ckpt"):
        trainer.fit(_Model(), data)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("twin", [AcceleratedFSDPStrategy, FabricAcceleratedFSDPStrategy])
def test_sharded_fsdp_refuses_lightnings_async_io_which_its_directory_would_bypass(twin: Any, tmp_path: Path) -> None:
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    strategy = twin(fsdp_plugin=plugin, checkpoint_io=AsyncCheckpointIO())
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO cannot save a sharded checkpoint.*AsyncNaming"):
        _save(strategy, tmp_path / "sharded")
    assert not (tmp_path / "sharded").exists()


@pytest.mark.skipif(not has_module("deepspeed"), reason="no deepspeed")
@pytest.mark.parametrize("trainer_twin", [True, False], ids=["Trainer", "Fabric"])
@pytest.mark.parametrize("io", [AsyncNamingCheckpointIO, AsyncCheckpointIO], ids=["ours", "Lightning's"])
def test_deepspeed_refuses_a_background_io_its_engine_would_ignore(trainer_twin: bool, io: Any, tmp_path: Path) -> None:
    from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy

    strategy = AcceleratedDeepSpeedStrategy() if trainer_twin else FabricAcceleratedDeepSpeedStrategy()
    strategy.checkpoint_io = io()
    with pytest.raises(ValueError, match=rf"{io.__name__} cannot save acc_deepspeed's checkpoint folder"):
        _save(strategy, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def _save(strategy: Any, path: Path) -> None:
    if isinstance(strategy, L.pytorch.strategies.Strategy):
        strategy.save_checkpoint({}, path)
    else:
        strategy.save_checkpoint(path, {})


@pytest.mark.parametrize(
    ("io", "save_on_each_node", "match"),
    [
        (AsyncCheckpointIO(), False, r"cannot follow Lightning's AsyncCheckpointIO.*AsyncNamingCheckpointIO\(\)"),
        (AsyncNamingCheckpointIO(), True, r"save_on_each_node=True\) copies each checkpoint.*save_on_each_node=False"),
    ],
)
def test_rotation_refuses_a_background_io_it_cannot_follow(
    tmp_path: Path, io: Any, save_on_each_node: bool, match: str
) -> None:
    config = ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True, save_on_each_node=save_on_each_node)
    rotation = CheckpointRotation(config, every_n_train_steps=1)
    trainer: Any = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io))
    with pytest.raises(ValueError, match=match):
        rotation.setup(trainer, L.LightningModule(), "fit")
