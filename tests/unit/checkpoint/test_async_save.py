"""``save_state(async_save=True)``: the state at the call, written by a thread, published once complete.

Each run trains while its checkpoint is written (the weights change under the writer); its files must be those of a
synchronous save at the same step, byte for byte (the sha256 of every file agrees), and a resume from either must end
where the uninterrupted run ends. An error in the background is raised by the next call; a save killed in the
background leaves the previous checkpoint the one that is loaded.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.checkpoint.background import HostBuffers, background_group, host_copy
from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from lightning_accel.utils import ProjectConfiguration, set_seed
from lightning_accel.utils.other import CheckpointWriteError
from tests.helpers import REPO, clean_env, free_port, reset_accelerator_states
from tests.unit.checkpoint.test_write_errors import file_size_limit

STEPS, SAVE_AT = 6, 3


def _run(root: Path, *, async_save: bool | None, resume: bool = False) -> tuple[dict[str, torch.Tensor], Path | None]:
    """Train ``STEPS`` steps (resumed: the rest after ``SAVE_AT``), saving at ``SAVE_AT`` (``None``: no save)."""
    reset_accelerator_states()
    set_seed(0)
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    batches = torch.randn(STEPS, 8, 16, generator=torch.Generator().manual_seed(1))
    first = 0
    if resume:
        accelerator.load_state()
        first = SAVE_AT
    saved = None
    for step in range(first, STEPS):
        if step == SAVE_AT and async_save is not None:
            saved = Path(accelerator.save_state(async_save=async_save))
        accelerator.backward(model(batches[step]).pow(2).mean() + torch.rand(()))  # the generator is saved too
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()  # finishes the background save
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, saved


def _digests(folder: Path) -> dict[str, str]:
    """Every file's sha256, the manifest's included (it records each file's checksum)."""
    assert (folder / MANIFEST_NAME).is_file()
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_an_async_save_writes_the_synchronous_files_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    uninterrupted, _ = _run(tmp_path / "plain", async_save=None)
    after_async, async_folder = _run(tmp_path / "async", async_save=True)
    after_sync, sync_folder = _run(tmp_path / "sync", async_save=False)
    assert async_folder is not None and sync_folder is not None
    assert async_folder.name == sync_folder.name == "checkpoint_0"
    assert _digests(async_folder) == _digests(sync_folder)  # byte for byte, though training went on while it wrote
    assert not list((tmp_path / "async" / "checkpoints").glob(".*incomplete*"))
    for final in (after_async, after_sync):
        for name, tensor in uninterrupted.items():
            assert torch.equal(final[name], tensor), name
    resumed_async, _ = _run(tmp_path / "async", async_save=None, resume=True)
    resumed_sync, _ = _run(tmp_path / "sync", async_save=None, resume=True)
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed_async[name], tensor), name
        assert torch.equal(resumed_sync[name], tensor), name


def _saves_every_step(root: Path, *, async_save: bool) -> list[Path]:
    reset_accelerator_states()
    set_seed(0)
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    folders = []
    for step in range(3):
        folders.append(Path(accelerator.save_state(async_save=async_save)))
        accelerator.backward(model(torch.full((4, 16), float(step))).pow(2).mean())
        optimizer.step()
    accelerator.end_training()
    return folders


def test_saves_that_reuse_the_last_host_copy_write_each_its_own_step(tmp_path: Path) -> None:
    asynchronous = _saves_every_step(tmp_path / "async", async_save=True)
    synchronous = _saves_every_step(tmp_path / "sync", async_save=False)
    assert [f.name for f in asynchronous] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    digests = [_digests(folder) for folder in asynchronous]
    assert digests == [_digests(folder) for folder in synchronous]
    assert digests[0]["optimizer.bin"] != digests[1]["optimizer.bin"] != digests[2]["optimizer.bin"]


def test_host_buffers_copy_into_the_last_copys_storages_where_the_sizes_match() -> None:
    buffers = HostBuffers()
    weight, tied = torch.zeros(8), torch.ones(3)
    state = {"a": weight, "a_view": weight[2:4], "b": tied}
    first = host_copy(state, buffers)
    weight.add_(5)
    second = host_copy(state, buffers)
    assert second["a"].untyped_storage().data_ptr() == first["a"].untyped_storage().data_ptr()
    assert second["a_view"].untyped_storage().data_ptr() == second["a"].untyped_storage().data_ptr()
    assert torch.equal(second["a"], torch.full((8,), 5.0)) and torch.equal(second["b"], tied)
    grown = host_copy({"a": torch.zeros(9), "b": tied}, buffers)
    assert grown["a"].untyped_storage().data_ptr() != first["a"].untyped_storage().data_ptr()
    assert grown["b"].untyped_storage().data_ptr() == first["b"].untyped_storage().data_ptr()
    buffers.release()
    assert host_copy(state, buffers)["b"].untyped_storage().data_ptr() != first["b"].untyped_storage().data_ptr()


def test_a_background_error_is_raised_by_the_next_call_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(128, 128))
    accelerator.save_state(tmp_path / "first")
    with file_size_limit(16_384):
        folder = accelerator.save_state(tmp_path / "second", async_save=True)  # returns: the write fails later
        assert folder == str(tmp_path / "second")
        with pytest.raises(CheckpointWriteError, match=r"Could not write model.safetensors in the folder .*\.second"):
            accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]
    accelerator.wait_for_checkpoint()  # raised once: nothing pending now
    accelerator.load_state(tmp_path / "first")
    assert model.weight.shape == (128, 128)


_KILLED = """
import os, signal, sys, torch
from lightning_accel import Accelerator
from lightning_accel.utils import ProjectConfiguration
config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
accelerator = Accelerator(cpu=True, project_config=config)
model = accelerator.prepare(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)]))  # 168 MB
accelerator.save_state()
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
accelerator.save_state(async_save=True)
os.kill(os.getpid(), signal.SIGKILL)  # while the thread writes checkpoint_1
"""


@pytest.mark.launch
def test_a_save_killed_in_the_background_is_never_loaded(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=clean_env(PYTHONPATH=str(REPO)), timeout=300, check=False
    )
    assert done.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".checkpoint_1.incomplete", "checkpoint_0"]
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = accelerator.prepare(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)]))
    assert accelerator.load_state() == str(checkpoints / "checkpoint_0")
    reference = torch.load(checkpoints / "checkpoint_0" / "random_states_0.pkl", weights_only=False)
    assert reference["step"] == 0
    from safetensors.torch import load_file

    saved = load_file(checkpoints / "checkpoint_0" / "model.safetensors")
    assert torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    accelerator.save_state()  # the next save takes the name and removes what the killed one left
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]


def test_host_copies_are_saved_as_the_originals_byte_for_byte() -> None:
    import io

    from lightning_accel.checkpoint.background import host_copy

    def saved(obj: object) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    layer = torch.nn.Linear(3, 3)
    tagged = torch.ones(3)
    tagged.ds_id = "0_3"  # an attribute torch.save records (DeepSpeed's flat groups carry one)
    state = {
        "parameter": layer.weight,  # a Parameter that requires grad (ZeRO's fp32 partitions)
        "row": layer.weight[0],  # a view of it: one storage in the file
        "grad": torch.ones(2, requires_grad=True),
        "empty": [torch.empty(0), torch.empty(0)],  # two empty storages, not one (ZeRO-3's placeholders)
        "tagged": tagged,
        "other": {"step": 3},
    }
    copied = host_copy(state)
    assert saved(copied) == saved(state)
    assert copied["parameter"].untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()
    assert copied["row"].untyped_storage().data_ptr() == copied["parameter"].untyped_storage().data_ptr()


def test_the_background_group_waits_as_long_as_the_default_group() -> None:
    """Its collectives end on the timeout given to ``init_process_group`` (17 s here), not on torch's 30 minutes."""
    import torch.distributed as dist

    timeout = timedelta(seconds=17)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout)
    try:
        group = background_group()
        assert group is not dist.group.WORLD
        assert group._get_backend(torch.device("cpu")).options._timeout == timeout
    finally:
        dist.destroy_process_group()
