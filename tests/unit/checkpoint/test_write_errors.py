"""A save that meets a full disk or the file size limit names the file, the folder and the cause, and loses nothing.

The file size limit is the process's own (``RLIMIT_FSIZE``, what ``ulimit -f`` sets; Python ignores ``SIGXFSZ``, so
the write fails with ``EFBIG``); the full disk is a 64 KiB tmpfs where this machine lets the test mount one. The
previous checkpoint stays the one ``load_state`` and rotation see, and no temporary folder is left behind.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.checkpoint.folders import abandon_on_error, numbered_checkpoints
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO
from lightning_accel.utils import ProjectConfiguration
from lightning_accel.utils.other import CheckpointWriteError

LIMIT = 16_384  # bytes: the weights below (64 KiB) do not fit, the first save is made before the limit


@contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _rotating_accelerator(root: Path) -> tuple[Accelerator, torch.nn.Module]:
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = accelerator.prepare(torch.nn.Linear(128, 128))
    return accelerator, model


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "torch_save"])
def test_a_save_past_the_file_size_limit_names_the_file_and_keeps_the_previous_checkpoint(
    tmp_path: Path, safe_serialization: bool
) -> None:
    accelerator, model = _rotating_accelerator(tmp_path)
    accelerator.save_state(safe_serialization=safe_serialization)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    with file_size_limit(LIMIT), pytest.raises(CheckpointWriteError) as raised:
        accelerator.save_state(safe_serialization=safe_serialization)
    error = raised.value
    assert error.errno == errno.EFBIG
    assert error.path.name == weights
    message = str(error)
    assert f"Could not write {weights} in the folder {tmp_path / 'checkpoints' / '.checkpoint_1.incomplete'}" in message
    assert "(EFBIG)" in message
    assert f"ulimit -f: {LIMIT} bytes" in message
    checkpoints = tmp_path / "checkpoints"
    assert sorted(entry.name for entry in checkpoints.iterdir()) == ["checkpoint_0"]  # no temporary folder left
    assert [entry.name for _, entry in numbered_checkpoints(checkpoints)] == ["checkpoint_0"]
    assert accelerator.load_state() == str(checkpoints / "checkpoint_0")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    accelerator.save_state(safe_serialization=safe_serialization)  # the limit gone, the next save rotates as usual
    assert [entry.name for _, entry in numbered_checkpoints(checkpoints)] == ["checkpoint_1"]


def test_rotation_writes_the_newest_checkpoint_to_disk_before_deleting_the_older(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, _ = _rotating_accelerator(tmp_path)
    accelerator.save_state()
    checkpoints = tmp_path / "checkpoints"
    synced_while_older_existed: set[Path] = set()
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        if (checkpoints / "checkpoint_0").exists():
            synced_while_older_existed.add(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    accelerator.save_state()
    newest = checkpoints / "checkpoint_1"
    assert [entry.name for _, entry in numbered_checkpoints(checkpoints)] == ["checkpoint_1"]
    written = {newest, *newest.rglob("*")}
    assert {"model.safetensors", "random_states_0.pkl"} <= {path.name for path in written}
    assert written <= synced_while_older_existed, sorted(written - synced_while_older_existed)


def test_a_full_disk_names_the_file_the_folder_and_the_free_space(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the test mount a small tmpfs: {mounted.stderr.decode().strip()}")
    try:
        accelerator = Accelerator(cpu=True)
        accelerator.prepare(torch.nn.Linear(8, 8))
        accelerator.save_state(disk / "first")
        accelerator.prepare(torch.nn.Linear(256, 256))  # 257 KiB of weights on a 64 KiB disk
        with pytest.raises(CheckpointWriteError) as raised:
            accelerator.save_state(disk / "second")
        assert raised.value.errno == errno.ENOSPC
        message = str(raised.value)
        assert f"in the folder {disk / '.second.incomplete'}: the disk is full (ENOSPC)" in message
        assert "bytes free now" in message
        assert sorted(entry.name for entry in disk.iterdir()) == ["first"]
        assert (disk / "first" / "model.safetensors").is_file()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_the_trainer_checkpoint_io_names_the_file_past_the_limit(tmp_path: Path) -> None:
    target = tmp_path / "epoch=0.ckpt"
    with file_size_limit(LIMIT), pytest.raises(CheckpointWriteError, match=r"Could not write epoch=0.ckpt") as raised:
        NamingTorchCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(16_384)}}, target)
    assert raised.value.errno == errno.EFBIG


def test_a_writer_that_hides_the_cause_is_diagnosed_from_the_machine(tmp_path: Path) -> None:
    """torch.save given a path (as DeepSpeed calls it) says only "unexpected pos"; the folder and limit say more."""
    folder = tmp_path / ".checkpoint_0.incomplete"
    folder.mkdir()
    with file_size_limit(LIMIT), pytest.raises(CheckpointWriteError) as raised, abandon_on_error(folder):
        torch.save({"w": torch.zeros(16_384)}, folder / "mp_rank_00_model_states.pt")
    assert raised.value.errno == errno.EFBIG
    assert raised.value.path.name == "mp_rank_00_model_states.pt"
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's own error stays the cause
    assert not folder.exists()


def test_other_errors_pass_through_unchanged(tmp_path: Path) -> None:
    folder = tmp_path / ".checkpoint_0.incomplete"
    folder.mkdir()
    with pytest.raises(ValueError, match="not a write error"), abandon_on_error(folder):
        raise ValueError("not a write error")
    assert not folder.exists()
