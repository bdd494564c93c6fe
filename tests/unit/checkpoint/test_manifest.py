"""``checkpoint_manifest.json``: what ``save_state`` wrote, checked by ``load_state`` before anything is read.

The sizes and checksums are recomputed here with ``zlib`` and ``hashlib`` directly; a flipped byte, a truncated file
and a missing one are each refused naming the file; a folder HF accelerate 1.15 wrote (no manifest) loads as before.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import accelerate
import pytest
import torch

from lightning_accel import Accelerator
from lightning_accel.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    Checksums,
    verify_manifest,
    write_manifest,
)
from lightning_accel.utils import ProjectConfiguration
from lightning_accel.utils.other import observing_writes, safetensors_save, torch_save
from tests.helpers import reset_accelerator_states


def _saved(root: Path, **save: str) -> tuple[Accelerator, Path]:
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(32, 32)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return accelerator, Path(accelerator.save_state(**save))


@pytest.mark.parametrize(
    ("save", "algorithm"),
    [({}, "crc32"), ({"checksum": "sha256"}, "sha256")],
    ids=["crc32 by default", "sha256"],
)
def test_the_manifest_lists_every_file_with_its_size_and_checksum(
    tmp_path: Path, save: dict[str, str], algorithm: str
) -> None:
    _, folder = _saved(tmp_path, **save)
    recorded = json.loads((folder / MANIFEST_NAME).read_text())
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME)
    assert files == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert sorted(recorded["files"]) == files
    for name in files:
        data = (folder / name).read_bytes()
        digest = f"{zlib.crc32(data):08x}" if algorithm == "crc32" else hashlib.sha256(data).hexdigest()
        assert recorded["files"][name] == {"size": len(data), algorithm: digest}, name
    assert verify_manifest(folder) is True


def test_a_file_rewritten_after_its_writer_recorded_it_is_checksummed_as_it_is_now(tmp_path: Path) -> None:
    checksums = Checksums()
    big = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: hashed on the side while written
    with observing_writes(checksums):
        torch_save(big, tmp_path / "streamed.bin")
        safetensors_save(big, tmp_path / "read_back.safetensors")
    (tmp_path / "streamed.bin").write_bytes(b"rewritten by someone else")
    write_manifest(tmp_path, checksums)
    recorded = json.loads((tmp_path / MANIFEST_NAME).read_text())["files"]
    for name in ("streamed.bin", "read_back.safetensors"):
        assert recorded[name]["crc32"] == f"{zlib.crc32((tmp_path / name).read_bytes()):08x}", name
    assert verify_manifest(tmp_path) is True


def test_an_unknown_checksum_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"checksum='md5' is not a checksum this package writes: use 'crc32'"):
        accelerator.save_state(tmp_path / "ckpt", checksum="md5")  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    accelerator, folder = _saved(tmp_path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight: safetensors itself would load it
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors has other contents than when saved"):
        accelerator.load_state()


def test_a_truncated_and_a_missing_file_are_both_named(tmp_path: Path) -> None:
    accelerator, folder = _saved(tmp_path)
    optimizer = folder / "optimizer.bin"
    size = optimizer.stat().st_size
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    (folder / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointIntegrityError) as raised:
        accelerator.load_state(folder)
    message = str(raised.value)
    assert f"The checkpoint {folder} is not what was saved" in message
    assert "random_states_0.pkl is missing" in message
    assert f"optimizer.bin has 100 bytes, {size} when saved (truncated or rewritten)" in message


def test_a_manifest_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    accelerator, folder = _saved(tmp_path)
    recorded = json.loads((folder / MANIFEST_NAME).read_text())
    recorded["files"]["../outside.bin"] = {"size": 1, "sha256": "0" * 64}
    (folder / MANIFEST_NAME).write_text(json.dumps(recorded))
    with pytest.raises(CheckpointIntegrityError, match=r"the entry '\.\./outside\.bin' points outside the folder"):
        accelerator.load_state(folder)


def test_a_folder_written_by_hf_accelerate_has_no_manifest_and_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    theirs = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    theirs.prepare(model)
    theirs.save_state(tmp_path / "hf")
    assert not (tmp_path / "hf" / MANIFEST_NAME).exists()
    reset_accelerator_states()
    ours = Accelerator(cpu=True)
    loaded = ours.prepare(torch.nn.Linear(4, 4))
    assert verify_manifest(tmp_path / "hf") is False
    ours.load_state(tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_without_checksums_the_manifest_records_sizes_and_still_finds_a_truncated_file(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(32, 32))
    folder = Path(accelerator.save_state(tmp_path / "ckpt", checksum=None))
    recorded = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    assert all(set(entry) == {"size"} for entry in recorded.values()), recorded
    assert recorded["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    assert verify_manifest(folder) is True  # a flipped bit passes where no digest was recorded
    weights.write_bytes(bytes(data[:-4]))
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors has \d+ bytes, \d+ when saved"):
        accelerator.load_state(folder)


def test_a_pickled_accelerator_carries_its_checksum_choice_and_no_thread(tmp_path: Path) -> None:
    import pickle

    checksums = pickle.loads(pickle.dumps(Checksums("sha256")))
    with observing_writes(checksums):
        torch_save({"w": torch.arange(1 << 19, dtype=torch.float32)}, tmp_path / "w.bin")
    write_manifest(tmp_path, checksums)
    recorded = json.loads((tmp_path / MANIFEST_NAME).read_text())["files"]["w.bin"]
    assert recorded["sha256"] == hashlib.sha256((tmp_path / "w.bin").read_bytes()).hexdigest()
