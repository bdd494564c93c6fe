"""2 CPU processes (gloo): ``AsyncNamingCheckpointIO`` on a Trainer and on Fabric against synchronous saves.

One ``torch.distributed.run`` launch of ``tests/scripts/trainer_async_checkpoint.py`` per strategy (~15-30 s on 2
cores) runs every scenario: a Trainer with ``CheckpointRotation(total_limit=2)`` and
``ModelCheckpoint(save_top_k=1, save_last=True)``, and Fabric saving twice to one path, each synchronously and in the
background, each resumed. ``acc_ddp`` and ``acc_fsdp`` with ``FULL_STATE_DICT`` write files (through a writer that
waits before each write); ``acc_fsdp`` with ``SHARDED_STATE_DICT`` writes directories with torch's ``dcp.async_save``.
"""

from __future__ import annotations

import errno
import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torchrun
from tests.scripts.trainer_async_checkpoint import FABRIC_SAVES, MAX_STEPS, SAVE_EVERY, TOTAL_LIMIT

pytestmark = pytest.mark.launch

SAVED_FILES = [
    "checkpoints/checkpoint_2",
    "checkpoints/checkpoint_3",
    f"mc/step={MAX_STEPS}.ckpt",
    "mc/last.ckpt",
    "fabric/fabric.ckpt",
]


@pytest.fixture(scope="module", params=["acc_ddp", "acc_fsdp", "acc_fsdp_full"])
def out(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    found: Path = tmp_path_factory.mktemp(f"async_io_{request.param}")
    torchrun("trainer_async_checkpoint.py", "--out", str(found), "--strategy", request.param, timeout=300)
    return found


@pytest.fixture
def files_only(out: Path) -> None:
    if _sharded(out):
        pytest.skip("acc_fsdp's sharded directories are written by DCP, not through the recording writer")


@pytest.fixture(scope="module")
def results(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"results_rank{rank}.pt", weights_only=False) for rank in range(2)]


def _sharded(out: Path) -> bool:
    """Whether ``out`` (``async_io_<strategy><n>``) holds the run of ``acc_fsdp`` with sharded checkpoints."""
    return out.name.rstrip("0123456789") == "async_io_acc_fsdp"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_background_checkpoints_are_the_synchronous_files_byte_for_byte(out: Path) -> None:
    # Nothing else is left (no ``.writing`` sibling, no ``.incomplete`` checkpoint): every write was published.
    assert _listing(out / "async") == _listing(out / "sync")
    for name in SAVED_FILES:
        assert name in _listing(out / "sync")
    for name in _listing(out / "sync"):
        ours, theirs = out / "async" / name, out / "sync" / name
        if ours.name == ".metadata":  # DCP's: the same plan and storage; it also names its folder and a random id
            mine, reference = pickle.loads(ours.read_bytes()), pickle.loads(theirs.read_bytes())
            assert mine.state_dict_metadata == reference.state_dict_metadata, name
            assert mine.storage_data == reference.storage_data, name
        elif ours.is_file():
            assert ours.read_bytes() == theirs.read_bytes(), name
        if ours.is_file() and ours.name != ".metadata" and ours.suffix != ".distcp":
            torch.load(ours, weights_only=True)  # complete, and weights-only loadable


def test_a_resume_from_a_background_checkpoint_ends_with_the_synchronous_resumes_weights(
    out: Path, results: list[dict[str, Any]]
) -> None:
    for rank_results in results:
        for what in ("trainer", "fabric"):
            from_async = rank_results[f"{what}_async_resumed"]["weights"]
            from_sync = rank_results[f"{what}_sync_resumed"]["weights"]
            assert from_async.keys() == from_sync.keys()
            for key, value in from_sync.items():
                assert torch.equal(from_async[key], value), (what, key)
        for key, value in rank_results["fabric_sync"]["weights"].items():  # and Fabric's resume is exact
            assert torch.equal(rank_results["fabric_async_resumed"]["weights"][key], value), key
    # The resumed runs trained on from the checkpoint: the comparison is not between two copies of one file.
    saved = results[0]["trainer_async"]["weights"]  # the first run's end: where the resumed one ends too?
    assert not torch.equal(results[0]["trainer_async_resumed"]["weights"]["net.0.weight"], saved["net.0.weight"])


def test_after_every_batch_the_previous_checkpoints_are_there_complete(results: list[dict[str, Any]]) -> None:
    listings = results[0]["trainer_async"]["listings"]  # rank 0's folders after each batch
    assert len(listings) == MAX_STEPS
    rotated = [len([e for e in listing.get("checkpoints", []) if not e.startswith(".")]) for listing in listings]
    assert rotated == sorted(rotated) and rotated[-1] == TOTAL_LIMIT, rotated  # never fewer than before
    best = [[e for e in listing.get("mc", []) if e.startswith("step=")] for listing in listings]
    assert all(len(found) == 1 for found in best[1:]), best  # the previous best until the new one landed


@pytest.mark.usefixtures("files_only")
def test_nothing_is_removed_or_rotated_before_the_new_checkpoint_landed(results: list[dict[str, Any]]) -> None:
    writes = results[0]["trainer_async"]["writes"]  # (file being written, listing of the folders then, -)
    assert not results[1]["trainer_async"]["writes"]  # only global rank 0 writes
    rotation = [(name, listing) for name, listing, _ in writes if name.startswith(".checkpoint_")]
    assert [name for name, _ in rotation] == [f".checkpoint_{i}.incomplete.writing" for i in range(4)]
    for index, (_, listing) in enumerate(rotation):
        # The newest `total_limit` earlier checkpoints are all still there while checkpoint_{index} is written.
        kept = [f"checkpoint_{i}" for i in range(max(0, index - TOTAL_LIMIT), index)]
        assert listing.get("checkpoints", []) == kept, (index, listing)
    best = [(name, listing) for name, listing, _ in writes if name.startswith(".step=")]
    assert len(best) >= 2
    for (previous, _), (name, listing) in itertools.pairwise(best):
        # The best file a new best replaces is on disk while the new one is written: removed only after it landed.
        assert previous.removeprefix(".").removesuffix(".writing") in listing["mc"], (name, listing)
    assert len([w for w in writes if w[0] == ".last.ckpt.writing"]) == MAX_STEPS
    assert len(rotation) == MAX_STEPS // SAVE_EVERY


@pytest.mark.usefixtures("files_only")
def test_fabric_keeps_the_previous_file_complete_while_the_next_is_written(results: list[dict[str, Any]]) -> None:
    writes = results[0]["fabric_async"]["writes"]
    assert [name for name, _, _ in writes] == [".fabric.ckpt.writing"] * len(FABRIC_SAVES)
    # While the second save is written, fabric.ckpt is the first one, complete (read back weights-only).
    assert [step for _, _, step in writes] == [None, FABRIC_SAVES[0]]


def test_a_failed_background_sharded_write_is_raised_on_every_process_and_keeps_the_previous(
    out: Path, results: list[dict[str, Any]]
) -> None:
    if not _sharded(out):
        pytest.skip("the sharded directory's error (every process) is acc_fsdp's; acc_ddp's file is a unit test")
    for rank_results in results:  # raised by the next save on both processes, naming the shard file and its folder
        found = rank_results["sharded_write_error"]
        assert found["error"] == "CheckpointWriteError" and found["errno"] == errno.EFBIG, found
        assert "Could not write __" in found["message"] and ".bad.writing: " in found["message"], found
        assert found["entries"] == [".bad.writing", "good"]  # never published; the next save never started
        assert found["restored"]  # the previous checkpoint loads: the weights saved in it
