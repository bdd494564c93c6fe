"""The checkpoint package (issue 22): one writer of save_state's files, one atomic-folder protocol, no import circle."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint.manifest import MANIFEST_NAME

PACKAGE = Path(__file__).resolve().parents[3] / "lightning_accel"


def _imports(path: Path) -> set[str]:
    """Every ``lightning_accel`` module ``path`` imports, lazily or under ``TYPE_CHECKING`` included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("lightning_accel")}


def test_checkpointing_and_the_checkpoint_package_import_no_shim() -> None:
    files = [PACKAGE / "checkpointing.py", *sorted((PACKAGE / "checkpoint").glob("*.py"))]
    upward = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in files
        for name in _imports(path)
        if name.startswith(("lightning_accel._accelerator", "lightning_accel.accelerator"))
    }
    assert upward == set()


def _run(tmp_path: Path) -> tuple[Path, Path]:
    """One prepared run, saved by ``Accelerator.save_state`` and by ``save_accelerator_state``."""
    from lightning_accel import Accelerator
    from lightning_accel.checkpointing import save_accelerator_state
    from lightning_accel.state import reset_state

    reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    (batch,) = next(iter(loader))
    accelerator.backward(model(batch).sum())
    optimizer.step()
    scheduler.step()
    by_accelerator = Path(accelerator.save_state(tmp_path / "accelerator"))
    by_function = tmp_path / "function"
    by_function.mkdir()
    save_accelerator_state(
        by_function,
        [accelerator.get_state_dict(model)],
        [optimizer],
        [scheduler],
        [loader],
        accelerator.process_index,
        accelerator.step,
    )
    reset_state()
    return by_accelerator, by_function


def test_save_state_and_save_accelerator_state_write_the_same_files(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    by_accelerator, by_function = _run(tmp_path)
    names = sorted(p.name for p in by_accelerator.iterdir())
    assert names == sorted([MANIFEST_NAME, *(p.name for p in by_function.iterdir())])  # Accelerate's function: none
    assert names == [MANIFEST_NAME, "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    ours, theirs = load_file(by_accelerator / "model.safetensors"), load_file(by_function / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
    for name in ("optimizer.bin", "scheduler.bin"):
        saved = torch.load(by_accelerator / name, weights_only=False)
        assert str(saved) == str(torch.load(by_function / name, weights_only=False))


def test_publish_moves_a_file_or_a_folder_and_rotation_keeps_the_newest(tmp_path: Path) -> None:
    from lightning_accel.checkpoint.folders import SaveTarget, numbered_checkpoints, publish, remove_incomplete, rotate

    for index in range(3):
        target = SaveTarget(tmp_path / f"checkpoint_{index}")
        if index == 1:
            target.temporary.write_text("a Trainer checkpoint file")
        else:
            target.temporary.mkdir()
            (target.temporary / "model.safetensors").write_text("weights")
        assert numbered_checkpoints(tmp_path, folders_only=False) == [
            (i, tmp_path / f"checkpoint_{i}") for i in range(index)
        ]
        publish(target)
        assert target.final.exists() and not target.temporary.exists()
    assert [i for i, _ in numbered_checkpoints(tmp_path)] == [0, 2]  # folders only: save_state's view
    (tmp_path / ".checkpoint_3.incomplete").mkdir()
    remove_incomplete(tmp_path)
    assert not (tmp_path / ".checkpoint_3.incomplete").exists()
    rotate(tmp_path, 2, folders_only=False)
    assert [p.name for _, p in numbered_checkpoints(tmp_path, folders_only=False)] == ["checkpoint_1", "checkpoint_2"]


def _own_and_defaults(tag: str) -> tuple[Any, Any]:
    def own(folder: Path) -> None:
        (folder / "random_states_1.pkl").write_text(f"rank 1 {tag}")

    def defaults(folder: Path) -> None:
        (folder / "dl_state_dict.bin").write_text(f"rank 1's loader {tag}")

    return own, defaults


@pytest.mark.parametrize("order", ["staged_first", "published_first"])
def test_a_staged_process_file_reaches_the_checkpoint_whoever_comes_second(tmp_path: Path, order: str) -> None:
    """Rank 1 stages its random states without waiting; the checkpoint gets them whether rank 0 publishes first."""
    from lightning_accel.checkpoint.folders import SaveTarget, numbered_checkpoints, publish, stage

    target = SaveTarget(tmp_path / "checkpoint_0")
    target.temporary.mkdir()
    (target.temporary / "model.safetensors").write_text("weights")
    (target.temporary / "dl_state_dict.bin").write_text("the publisher's loader")
    if order == "published_first":
        publish(target)
    stage(target, 1, *_own_and_defaults("fresh"))
    assert numbered_checkpoints(tmp_path) == ([(0, target.final)] if order == "published_first" else [])
    if order == "staged_first":
        assert [p.name for p in target.staged()] == [".checkpoint_0.process_1.incomplete"]
        publish(target)
    files = {p.name: p.read_text() for p in target.final.iterdir()}
    assert files == {
        "model.safetensors": "weights",
        "random_states_1.pkl": "rank 1 fresh",
        "dl_state_dict.bin": "the publisher's loader",  # a staged default never replaces the publisher's file
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_0"]  # nothing staged is left behind


def test_a_staged_default_fills_a_folder_of_its_own_and_a_stale_staging_is_replaced(tmp_path: Path) -> None:
    """A process saving into a folder no other process publishes (its own output_dir) keeps its own loader state."""
    from lightning_accel.checkpoint.folders import SaveTarget, remove_incomplete, stage

    target = SaveTarget(tmp_path / "mine")
    target.final.mkdir()  # the user's folder exists already: handed in at once
    stale = target.staging(1)
    stale.mkdir()
    (stale / "random_states_1.pkl").write_text("from a killed save")
    stage(target, 1, *_own_and_defaults("fresh"))
    assert {p.name: p.read_text() for p in target.final.iterdir()} == {
        "random_states_1.pkl": "rank 1 fresh",
        "dl_state_dict.bin": "rank 1's loader fresh",
    }
    for name in (".checkpoint_4.process_1.incomplete", ".checkpoint_4.process_1.incomplete.writing"):
        (tmp_path / name).mkdir()
    remove_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_another_nodes_publisher_writes_a_temporary_of_its_own_and_merges_when_second(tmp_path: Path) -> None:
    from lightning_accel.checkpoint.folders import SaveTarget, publish

    main, other = SaveTarget(tmp_path / "ckpt"), SaveTarget(tmp_path / "ckpt", publisher=2)
    assert other.temporary.name == ".ckpt.publisher_2.incomplete" and main.temporary.name == ".ckpt.incomplete"
    for target, text in ((main, "main"), (other, "node 1")):
        target.temporary.mkdir()
        (target.temporary / "model.safetensors").write_text(text)
    publish(main)
    publish(other)  # shared storage: the folder exists, its files are replaced one by one
    assert (tmp_path / "ckpt" / "model.safetensors").read_text() == "node 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_fsdp_strategy_answers_with_its_checkpoint_engine() -> None:
    from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint
    from lightning_accel.strategies.fsdp import FabricAcceleratedFSDPStrategy
    from lightning_accel.strategies.single_device import FabricAcceleratedSingleDeviceStrategy
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    engine = FabricAcceleratedFSDPStrategy(plugin).checkpoint_engine()
    assert isinstance(engine, FSDPCheckpoint) and not engine.full and engine.after_load is not None
    assert FabricAcceleratedSingleDeviceStrategy(torch.device("cpu")).checkpoint_engine() is None


@pytest.mark.parametrize("full", [True, False])
def test_state_dict_policy_never_offloads_a_model_already_on_cpu(full: bool) -> None:
    from lightning_accel.checkpoint.fsdp_policy import state_dict_options

    options = state_dict_options(torch.nn.Linear(2, 2), full)
    assert options.full_state_dict is full
    assert options.cpu_offload is False


def test_state_dict_policy_honours_the_plugins_configs() -> None:
    from torch.distributed.fsdp import FullStateDictConfig, ShardedOptimStateDictConfig

    from lightning_accel.checkpoint.fsdp_policy import state_dict_options

    off_cpu = torch.nn.Linear(2, 2, device="meta")
    assert state_dict_options(off_cpu, full=True).cpu_offload is True
    assert state_dict_options(off_cpu, full=False).cpu_offload is False
    assert state_dict_options(off_cpu, True, FullStateDictConfig(offload_to_cpu=False)).cpu_offload is False
    assert state_dict_options(off_cpu, False, ShardedOptimStateDictConfig(offload_to_cpu=True)).cpu_offload is True
    assert state_dict_options(off_cpu, True, broadcast=True).broadcast_from_rank0 is True


def test_save_state_under_fsdp_reads_the_plugins_configs() -> None:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint
    from lightning_accel.strategies.fsdp import FabricAcceleratedFSDPStrategy
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    model_config, optim_config = FullStateDictConfig(offload_to_cpu=False), FullOptimStateDictConfig()
    plugin = FullyShardedDataParallelPlugin(
        state_dict_type="FULL_STATE_DICT", state_dict_config=model_config, optim_state_dict_config=optim_config
    )
    engine = FabricAcceleratedFSDPStrategy(plugin).checkpoint_engine()
    assert isinstance(engine, FSDPCheckpoint)
    assert engine.configs == {"model": model_config, "optimizer": optim_config}


def test_accelerates_fsdp_functions_refuse_a_config_of_another_kind(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from torch.distributed.fsdp import FullStateDictConfig

    from lightning_accel.utils import FullyShardedDataParallelPlugin, save_fsdp_model

    plugin = FullyShardedDataParallelPlugin(
        state_dict_type="SHARDED_STATE_DICT", state_dict_config=FullStateDictConfig()
    )
    accelerator = SimpleNamespace(num_processes=1, process_index=0)
    with pytest.raises(ValueError, match=r"state_dict_config=FullStateDictConfig.*ShardedStateDictConfig"):
        save_fsdp_model(plugin, accelerator, torch.nn.Linear(2, 2), tmp_path)
    assert not any(tmp_path.iterdir())
