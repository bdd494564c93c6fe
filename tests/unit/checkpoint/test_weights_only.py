"""Every checkpoint load is weights-only: a planted pickle runs nothing without the opt-in, and the refusal names it.

Each test plants a pickle that creates a marker file when unpickled in a file one loader opens, and checks that the
marker is not created, that the error names the file and ``weights_only=False``, and (where the loader has one) that
the opt-in loads it with a warning naming the file. Paths a checkpoint names must stay inside its folder.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_accel.big_modeling import load_checkpoint_and_dispatch
from lightning_accel.checkpoint.engines import DeepSpeedCheckpoint
from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint
from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from lightning_accel.checkpoint.state_files import load_custom_file, load_loader_files, load_samplers, load_state_dicts
from lightning_accel.checkpointing import load_custom_state
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO
from lightning_accel.strategies.deepspeed import check_deepspeed_folder
from lightning_accel.strategies.fsdp_core import FSDPFamily
from lightning_accel.utils import load_full_state_dict, merge_fsdp_weights
from lightning_accel.utils.modeling.checkpoint import (
    consolidate_deepspeed_checkpoint,
    contained_path,
    load_checkpoint_in_model,
    load_state_dict,
)
from lightning_accel.utils.other import UnsafeCheckpointError


class _Planted:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path, content: Any) -> None:
        self.marker = marker
        self.content = content

    def __reduce__(self) -> tuple[Any, tuple[str, Any]]:
        return (_touch, (str(self.marker), self.content))


def _touch(path: str, content: Any) -> Any:
    Path(path).touch()
    return content


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def _refusal(path: Path) -> str:
    """The refusal's text for ``path``: refused as unsafe, naming the file and the opt-in."""
    return rf"Refused to load {re.escape(str(path))}.* as unsafe.*weights_only=False"


def _plant(path: Path, content: Any = None) -> Path:
    """Write a pickle at ``path`` that creates ``<path>.ran`` when unpickled and then returns ``content``.

    The attacker rewrites the folder's manifest too (it is no signature), here by removing it: what is tested is that
    nothing runs even when the files look as saved.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    marker = path.with_name(path.name + ".ran")
    torch.save(_Planted(marker, {"count": 1} if content is None else content), path)
    (path.parent / MANIFEST_NAME).unlink(missing_ok=True)
    return marker


# --------------------------------------------------------------------------- save_state files


def test_planted_custom_checkpoint_refused_naming_file_and_opt_in(tmp_path: Path) -> None:
    file = tmp_path / "custom_checkpoint_0.pkl"
    marker = _plant(file)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)) as caught:
        load_custom_file(_Counter(), tmp_path, 0)
    assert "truncated" not in str(caught.value)  # a refusal is not reported as a broken file
    assert not marker.exists()
    with pytest.raises(ValueError, match=_refusal(file)):
        load_custom_state(_Counter(), tmp_path, 0)  # Accelerate's public path (its signature has no switch)
    assert not marker.exists()
    counter = _Counter()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        load_custom_file(counter, tmp_path, 0, weights_only=False)
    assert marker.exists() and counter.count == 1  # the opt-in unpickles in full


def test_plain_custom_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    torch.save({"count": 7}, tmp_path / "custom_checkpoint_0.pkl")
    counter = _Counter()
    load_custom_file(counter, tmp_path, 0)
    assert counter.count == 7


def test_planted_optimizer_file_refused_and_load_kwargs_opt_in(tmp_path: Path) -> None:
    file = tmp_path / "optimizer.bin"
    marker = _plant(file)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_state_dicts([_Counter()], tmp_path, "optimizer")
    assert not marker.exists()
    counter = _Counter()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        load_state_dicts([counter], tmp_path, "optimizer", weights_only=False)  # load_state's load_kwargs
    assert marker.exists() and counter.count == 1


def test_planted_sampler_refused(tmp_path: Path) -> None:
    file = tmp_path / "sampler.bin"
    marker = _plant(file, RandomSampler(range(4)))
    loader = DataLoader(TensorDataset(torch.arange(4.0)), sampler=RandomSampler(range(4)))
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_samplers([loader], tmp_path, lambda _: loader.sampler)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_loader_files([loader], tmp_path, lambda _: loader.sampler)  # load_accelerator_state's reader
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        load_loader_files([loader], tmp_path, lambda _: loader.sampler, weights_only=False)  # its load_kwargs
    assert marker.exists()


def test_hf_accelerate_folder_loads(tmp_path: Path) -> None:
    """A folder HF accelerate 1.15's save_state wrote loads weights-only; its sampler file as HF's save writes it."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import save as hf_save

    from lightning_accel.checkpointing import load_accelerator_state

    hf = accelerate.Accelerator(cpu=True)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = hf.prepare(model, optimizer, scheduler)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    counter = _Counter()
    counter.count = 3
    hf.register_for_checkpointing(counter)
    folder = tmp_path / "ckpt"
    hf.save_state(str(folder))

    restored = _Counter()
    load_custom_file(restored, folder, 0)
    assert restored.count == 3
    plain = nn.Linear(3, 2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_optimizer, step_size=1)
    load_accelerator_state(folder, [plain], [plain_optimizer], [plain_scheduler], [], 0)  # random states too
    assert torch.equal(plain.weight, hf.unwrap_model(model).weight)
    assert plain_optimizer.state_dict()["state"][0]["step"] == 1
    assert plain_scheduler.state_dict()["last_epoch"] == 1

    dataset = TensorDataset(torch.arange(8.0))
    written = SeedableRandomSampler(dataset, generator=torch.Generator().manual_seed(5))
    hf_save(written, folder / "sampler.bin", safe_serialization=False)  # what HF's save_state does for a sampler
    target = DataLoader(dataset, sampler=RandomSampler(dataset))
    load_samplers([target], folder, lambda _: target.sampler)
    restored_sampler = cast(BatchSampler, target.batch_sampler).sampler  # where a plain loader's batch sampler holds it
    assert isinstance(restored_sampler, SeedableRandomSampler)
    assert list(restored_sampler) == list(written)


# --------------------------------------------------------------------------- offline readers and big-model loading


def test_load_full_state_dict_refuses_a_planted_file_and_loads_with_the_opt_in(tmp_path: Path) -> None:
    file = tmp_path / "last.ckpt"
    weights = nn.Linear(2, 2).state_dict()
    marker = _plant(file, {"state_dict": weights})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_full_state_dict(file)
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        state = load_full_state_dict(file, weights_only=False)
    assert marker.exists() and torch.equal(state["weight"], weights["weight"])


def test_load_full_state_dict_refuses_a_planted_entry_of_a_sharded_folder(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "sharded"
    marker = tmp_path / "ran"
    with pytest.warns(UserWarning):  # DCP warns that it saves in one process
        dcp.save({"state_dict": {"w": torch.ones(2), "extra": _Planted(marker, 1)}}, checkpoint_id=folder)
    torch.save({"epoch": 1}, folder / "meta.pt")
    with pytest.raises(
        UnsafeCheckpointError, match=rf"{re.escape(str(folder))} \(its entry .*extra.*weights_only=False"
    ):
        load_full_state_dict(folder)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(folder))):
        merge_fsdp_weights(folder, tmp_path / "merged")  # Accelerate's merge reads every entry
    assert not marker.exists()


def test_a_sharded_folder_naming_a_shard_outside_it_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "sharded"
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=folder)
    torch.save({}, folder / "meta.pt")
    metadata_file = folder / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=rf"{re.escape(str(metadata_file))} names '\.\./elsewhere\.distcp'.*outside"):
        load_full_state_dict(folder)


def test_a_planted_dcp_metadata_file_is_refused_before_dcp_unpickles_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "sharded"
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=folder)
    torch.save({}, folder / "meta.pt")
    metadata_file = folder / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    marker = tmp_path / "ran"
    metadata_file.write_bytes(pickle.dumps(_Planted(marker, metadata)))
    with pytest.raises(UnsafeCheckpointError, match=_refusal(metadata_file)):
        load_full_state_dict(folder)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(metadata_file)):
        merge_fsdp_weights(folder, tmp_path / "merged")
    assert not marker.exists()
    metadata_file.write_bytes(pickle.dumps(metadata))  # DCP's own file loads
    assert torch.equal(load_full_state_dict(folder)["w"], torch.ones(2))


def test_load_checkpoint_in_model_and_load_state_dict_refuse_a_planted_file(tmp_path: Path) -> None:
    file = tmp_path / "pytorch_model.bin"
    weights = nn.Linear(2, 2).state_dict()
    marker = _plant(file, weights)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_state_dict(file)
    model = nn.Linear(2, 2)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_checkpoint_in_model(model, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_checkpoint_and_dispatch(model, tmp_path, device_map={"": "cpu"})
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        load_checkpoint_in_model(model, tmp_path, weights_only=False)
    assert marker.exists() and torch.equal(model.weight, weights["weight"])


def test_a_safetensors_index_naming_a_shard_outside_the_folder_is_refused(tmp_path: Path) -> None:
    save_file(nn.Linear(2, 2).state_dict(), tmp_path / "x.safetensors")  # a real file, outside the checkpoint
    folder = tmp_path / "ckpt"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"weight": "../x.safetensors", "bias": "../x.safetensors"}}))
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    expected = (
        rf"{re.escape(str(index))} names '\.\./x\.safetensors'.*outside the checkpoint folder {re.escape(str(folder))}"
    )
    with pytest.raises(ValueError, match=expected):
        load_checkpoint_in_model(model, folder)
    with pytest.raises(ValueError, match=expected):
        load_checkpoint_in_model(model, index)
    assert torch.equal(model.weight, before)


def test_contained_path_keeps_inner_paths_and_refuses_others(tmp_path: Path) -> None:
    assert contained_path(tmp_path, "a/b.bin", tmp_path / "index.json") == (tmp_path / "a" / "b.bin").resolve()
    for entry in ("../x", "/etc/passwd", "a/../../x", "."):
        with pytest.raises(ValueError, match=rf"index\.json names '{re.escape(entry)}'"):
            contained_path(tmp_path, entry, tmp_path / "index.json")
    (tmp_path / "link").symlink_to(tmp_path.parent)
    with pytest.raises(ValueError, match="outside"):
        contained_path(tmp_path, "link/x", tmp_path / "index.json")


# --------------------------------------------------------------------------- DeepSpeed folders


def _deepspeed_folder(root: Path, tag: str = "global_step1") -> Path:
    root.mkdir()
    (root / "latest").write_text(tag)
    return root / tag


def test_a_no_zero_deepspeed_folder_with_a_planted_model_states_file(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    weights = nn.Linear(2, 2).state_dict()
    file = _deepspeed_folder(root) / "mp_rank_00_model_states.pt"
    marker = _plant(file, {"module": weights})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        consolidate_deepspeed_checkpoint(root)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        load_full_state_dict(root)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        check_deepspeed_folder(root, None)  # what the acc_deepspeed strategies run before DeepSpeed's loader
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        state = consolidate_deepspeed_checkpoint(root, weights_only=False)
    assert marker.exists() and torch.equal(state["weight"], weights["weight"])


def test_a_planted_zero_optimizer_file_is_refused_before_deepspeed_reads_it(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    tag_folder = _deepspeed_folder(root)
    tag_folder.mkdir()
    torch.save({"module": nn.Linear(2, 2).state_dict()}, tag_folder / "mp_rank_00_model_states.pt")
    file = tag_folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    marker = _plant(file, {})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        consolidate_deepspeed_checkpoint(root)  # ZeRO's merge (deepspeed's zero_to_fp32) is not reached
    save_state_folder = tmp_path / "save_state"
    _plant(save_state_folder / "pytorch_model" / "mp_rank_00_model_states.pt", {})
    with pytest.raises(UnsafeCheckpointError, match=r"pytorch_model/mp_rank_00_model_states\.pt"):
        DeepSpeedCheckpoint().load([nn.Linear(2, 2)], [], save_state_folder)  # before any engine is asked
    assert not marker.exists()


def test_a_planted_full_weights_file_of_a_deepspeed_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    file = root / "pytorch_model.bin"
    marker = _plant(file, nn.Linear(2, 2).state_dict())
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        consolidate_deepspeed_checkpoint(root)
    assert not marker.exists()


def test_a_latest_tag_outside_the_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"module": nn.Linear(2, 2).state_dict()}, outside / "mp_rank_00_model_states.pt")
    root = tmp_path / "ds"
    _deepspeed_folder(root, tag="../outside")
    expected = (
        rf"{re.escape(str(root / 'latest'))} names '\.\./outside'.*outside the checkpoint folder {re.escape(str(root))}"
    )
    with pytest.raises(ValueError, match=expected):
        consolidate_deepspeed_checkpoint(root)
    with pytest.raises(ValueError, match=expected):
        check_deepspeed_folder(root, None)


# --------------------------------------------------------------------------- Trainer / Fabric checkpoint readers


def test_the_strategies_checkpoint_io_refuses_a_planted_file(tmp_path: Path) -> None:
    file = tmp_path / "epoch=0.ckpt"
    marker = _plant(file, {"state_dict": {}})
    io = NamingTorchCheckpointIO()
    for weights_only in (None, True):  # Lightning's default (None) is weights-only here too
        with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
            io.load_checkpoint(file, weights_only=weights_only)
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        assert io.load_checkpoint(file, weights_only=False) == {"state_dict": {}}
    assert marker.exists()


def test_acc_fsdp_readers_refuse_a_planted_file_and_a_planted_meta_file(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    family = FSDPFamily(None)
    file = tmp_path / "full.ckpt"
    marker = _plant(file, {"epoch": 1})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        family.load_into(file, {"epoch": 0}, nn.Linear(2, 2))
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        family.load_raw_module(file, nn.Linear(2, 2))  # fabric.load_raw
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        state = {"epoch": 0}
        family.load_into(file, state, nn.Linear(2, 2), weights_only=False)
    assert state == {"epoch": 1}
    folder = tmp_path / "sharded"
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=folder)
    meta = folder / "meta.pt"
    meta_marker = _plant(meta, {"epoch": 1})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(meta)), pytest.warns(UserWarning):
        family.load_into(folder, {"epoch": 0}, nn.Linear(2, 2))
    assert not meta_marker.exists()


def test_save_state_fsdp_files_refuse_a_planted_gathered_file(tmp_path: Path) -> None:
    file = tmp_path / "pytorch_model_fsdp.bin"
    marker = _plant(file, nn.Linear(2, 2).state_dict())
    _plant(tmp_path / "optimizer.bin", {})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        FSDPCheckpoint("FULL_STATE_DICT").load([nn.Linear(2, 2)], [], tmp_path)
    assert not marker.exists()


def test_fabric_load_under_an_acc_strategy_refuses_a_planted_checkpoint(tmp_path: Path) -> None:
    import lightning as L

    import lightning_accel  # noqa: F401  (registers the acc_* names)

    file = tmp_path / "fabric.ckpt"
    marker = _plant(file, {"step": 3})
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_no")
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        fabric.load(file)
    assert not marker.exists()
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        assert fabric.load(file, weights_only=False) == {"step": 3}
    assert marker.exists()


def test_accelerator_load_state_refuses_a_planted_custom_object_and_trusts_with_weights_only_false(
    tmp_path: Path,
) -> None:
    from lightning_accel import Accelerator

    accelerator = Accelerator(cpu=True)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    folder = Path(accelerator.save_state(tmp_path / "ckpt"))
    file = folder / "custom_checkpoint_0.pkl"
    marker = _plant(file, {"count": 5})
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        accelerator.load_state(folder)
    with pytest.raises(UnsafeCheckpointError, match=_refusal(file)):
        accelerator.load_state(folder, load_kwargs={"weights_only": False})  # Accelerate's opt-in: not its files
    assert not marker.exists() and counter.count == 0
    with pytest.raises(ValueError, match=r"weights_only=True and load_kwargs=\{'weights_only': False\}"):
        accelerator.load_state(folder, load_kwargs={"weights_only": False}, weights_only=True)
    with pytest.warns(UserWarning, match=re.escape(str(file))):
        accelerator.load_state(folder, weights_only=False)
    assert marker.exists() and counter.count == 5
