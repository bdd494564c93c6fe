"""Checkpoints from elsewhere (a killed save, another run, another world size): refused or restored, said (issue 23)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from lightning_accel.utils import set_seed
from tests.helpers import REPO, reset_accelerator_states, run_python, torchrun

_NAMED = ("acc_no", "acc_multi_cpu", "acc_fsdp", "acc_parallel", "fabric:acc_no", "fabric:acc_fsdp")
_STRATEGIES = (*_NAMED, "acc_deepspeed")


@pytest.mark.launch
def test_trainer_resume_from_a_corrupted_ckpt_names_the_file_under_every_strategy(tmp_path: Path) -> None:
    """Lightning (and torch) raise ``PytorchStreamReader failed reading zip archive`` without the file's path."""
    run_python(
        [str(REPO / "tests" / "scripts" / "bad_input_corrupt_ckpt.py"), str(tmp_path), *_STRATEGIES], timeout=600
    )
    results = json.loads((tmp_path / "results.json").read_text())
    path = str(tmp_path / "last.ckpt")
    for strategy in _NAMED:
        raised = results[strategy]
        assert raised["type"] == "ValueError", (strategy, raised)
        assert raised["message"].startswith(f"Could not read checkpoint file {path}: PytorchStreamReader"), raised
        assert "truncated or corrupt" in raised["message"]
    # DeepSpeed resumes from a checkpoint directory; Lightning already refuses a file, naming it.
    assert results["acc_deepspeed"] == {
        "type": "FileNotFoundError",
        "message": f"The provided path is not a valid DeepSpeed checkpoint: {path}",
    }


def _one_process_run(batches: int) -> tuple[Accelerator, torch.nn.Module, DataLoader]:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.arange(4.0 * batches).reshape(2 * batches, 2)), batch_size=2)
    model, data = accelerator.prepare(model, data)
    return accelerator, model, data


def _save_at(accelerator: Accelerator, data: DataLoader, epoch_and_batch: tuple[int, int], folder: Path) -> None:
    for epoch in range(epoch_and_batch[0] + 1):
        for step, _ in enumerate(data):
            if (epoch, step + 1) == epoch_and_batch:
                accelerator.save_state(folder)
                return


@pytest.mark.launch
def test_a_checkpoint_saved_by_2_processes_loads_into_1_restoring_all_but_the_position(tmp_path: Path) -> None:
    """HF accelerate 1.15 loads it silently (it restores no loader position or epoch: epoch 0 restarts)."""
    torchrun("bad_input_save_at_two.py", str(tmp_path), timeout=300)
    reset_accelerator_states()
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.arange(64.0).reshape(32, 2)), batch_size=2, shuffle=True)
    model, data = accelerator.prepare(model, data)
    with pytest.warns(UserWarning, match=r"saved by 2 processes and is loaded by 1: .*epochs \[1\] are.*not their "
                                         r"positions"):  # fmt: skip
        accelerator.load_state(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "weights.pt")
    torch.testing.assert_close(accelerator.unwrap_model(model).state_dict(), saved)
    assert len(data) == 16 and sum(1 for _ in data) == 16  # epoch 1 again from its first batch, all of it
    assert data.iteration == 2
    reset_accelerator_states()


def test_a_resume_position_past_the_loader_end_is_refused_naming_it_the_length_and_the_file(tmp_path: Path) -> None:
    """HF accelerate 1.15 records no position; ours once let such a file make the epoch yield nothing."""
    accelerator, _, data = _one_process_run(batches=8)
    _save_at(accelerator, data, (0, 6), tmp_path / "long")
    reset_accelerator_states()
    accelerator, _, data = _one_process_run(batches=4)
    _save_at(accelerator, data, (0, 2), tmp_path / "short")
    shutil.copy(tmp_path / "long" / "random_states_0.pkl", tmp_path / "short" / "random_states_0.pkl")
    (tmp_path / "short" / MANIFEST_NAME).unlink()  # else the manifest refuses the copied file first
    file = tmp_path / "short" / "random_states_0.pkl"
    refused = rf"{file} resumes data loader 0 at batch 6 of its epoch, but the loader has 4 batches per epoch "
    refused += r"\(the run that saved had 8\), so the epoch would yield nothing"
    with pytest.raises(ValueError, match=refused):
        accelerator.load_state(tmp_path / "short", resume_position=True)
    reset_accelerator_states()


def test_a_position_recorded_for_a_loader_of_another_length_is_not_restored(tmp_path: Path) -> None:
    accelerator, _, data = _one_process_run(batches=8)
    _save_at(accelerator, data, (0, 3), tmp_path / "long")
    reset_accelerator_states()
    accelerator, _, data = _one_process_run(batches=4)
    with pytest.warns(UserWarning, match=r"records data loader 0 with 8 batches per epoch, but it has 4 now.*batch 3"):
        accelerator.load_state(tmp_path / "long", resume_position=True)
    assert sum(1 for _ in data) == 4
    reset_accelerator_states()


def test_the_same_loader_resumes_at_its_position(tmp_path: Path) -> None:
    accelerator, _, data = _one_process_run(batches=8)
    _save_at(accelerator, data, (1, 3), tmp_path / "ckpt")
    reset_accelerator_states()
    accelerator, _, data = _one_process_run(batches=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerator.load_state(tmp_path / "ckpt", resume_position=True)
    assert [x[0].tolist() for x in data] == [[[4.0 * i, 4.0 * i + 1], [4.0 * i + 2, 4.0 * i + 3]] for i in range(3, 8)]
    reset_accelerator_states()


def test_the_offline_checkpoint_readers_name_a_truncated_file(tmp_path: Path) -> None:
    """``load_full_state_dict`` and the DeepSpeed consolidation read with torch: its error names no file."""
    from lightning_accel.utils import load_full_state_dict
    from lightning_accel.utils.modeling.checkpoint import consolidate_deepspeed_checkpoint

    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": torch.nn.Linear(2, 2).state_dict()}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"Could not read checkpoint file {ckpt}: .*truncated or corrupt"):
        load_full_state_dict(ckpt)
    deepspeed_dir = tmp_path / "ds"
    deepspeed_dir.mkdir()
    (deepspeed_dir / "pytorch_model.bin").write_bytes(ckpt.read_bytes())
    with pytest.raises(ValueError, match=rf"Could not read checkpoint file {deepspeed_dir / 'pytorch_model.bin'}"):
        consolidate_deepspeed_checkpoint(deepspeed_dir)


def test_a_save_model_that_fails_midway_leaves_the_previous_save_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second shard's write fails (as a full disk or a kill would end it): nothing of the last save is lost."""
    import safetensors.torch

    from lightning_accel.checkpointing import save_model

    state = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(3)}
    save_model(state, tmp_path, max_shard_size="1KB")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(before) == 4  # three shards and the index
    real_save_file, calls = safetensors.torch.save_file, []

    def failing_second_write(*args: object, **kwargs: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save_file(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors.torch, "save_file", failing_second_write)
    changed = {name: tensor + 1 for name, tensor in state.items()}
    with pytest.raises(
        OSError,
        match=r"Could not write .*model-00002-of-00003.safetensors.partial in the folder .*"
        r": the disk is full \(ENOSPC\)",
    ):
        save_model(changed, tmp_path, max_shard_size="1KB")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.endswith(".partial")}
    assert after == before
