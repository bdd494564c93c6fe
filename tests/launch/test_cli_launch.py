"""``lightning-accel launch`` end to end: real processes through ``torch.distributed.run`` on CPU (gloo, loopback).

Each test starts the launcher as a subprocess (``python -m lightning_accel.cli``, what the ``lightning-accel`` console
script runs) with ``HF_HOME`` pointing at an empty directory, so no default config of this machine leaks in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_accel
from tests.helpers import ACCELERATE_CONFIGS, SCRIPTS, clean_env, free_port, run_python, wait_all

FIXTURES = ACCELERATE_CONFIGS
LAUNCH = ["-m", "lightning_accel.cli", "launch"]
TIMEOUT = 240


def _rank_facts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def test_multi_cpu_file_starts_two_processes_for_a_trainer_script(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "multi_cpu.yaml"),
            str(SCRIPTS / "launch_trainer.py"),
            "--out",
            str(out),
            "--trainer",
            "kwargs",
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert [f["global_rank"] for f in facts] == [0, 1]
    for f in facts:
        assert f["world_size"] == 2
        assert f["strategy"] == "AcceleratedDDPStrategy"
        assert f["distributed_type"] == "MULTI_CPU"
        assert f["process_group_backend"] == "gloo"
        assert f["steps"] == 2


def test_multi_cpu_file_runs_an_accelerate_style_script_with_the_command_line_precision(tmp_path: Path) -> None:
    if not hasattr(lightning_accel, "Accelerator"):
        pytest.skip("the lightning_accel.Accelerator shim is not in this checkout")
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "multi_cpu.yaml"),
            "--mixed_precision",
            "bf16",
            str(SCRIPTS / "launch_accelerator.py"),
            "--out",
            str(out),
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert [(f["process_index"], f["local_process_index"]) for f in facts] == [(0, 0), (1, 1)]
    for f in facts:
        assert (f["num_processes"], f["distributed_type"], f["device"]) == (2, "MULTI_CPU", "cpu")
        assert f["mixed_precision"] == "bf16"  # --mixed_precision wins over the file's 'no'
        assert f["steps"] == 4  # 64 samples, batch 8, split over 2 processes


def test_fsdp_file_with_use_cpu_shards_the_model_on_cpu_under_acc_auto(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_python(
        [
            *LAUNCH,
            "--config_file",
            str(FIXTURES / "fsdp2_cpu.yaml"),
            str(SCRIPTS / "launch_trainer.py"),
            "--out",
            str(out),
            "--trainer",
            "auto",
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    facts = _rank_facts(out)
    assert len(facts) == 2
    for f in facts:
        assert f["strategy"] == "AcceleratedFSDPStrategy"
        assert f["distributed_type"] == "FSDP"
        assert f["fsdp_version"] == 2
        assert f["process_group_backend"] == "gloo"
        assert f["dtensor_params"] == 4  # both Linear layers' weight and bias are sharded
    assert sum(f["local_numel"] for f in facts) == facts[0]["full_numel"]  # each rank holds its shard only


def _start_node(rank: int, port: int, script: str, out: Path, hf_home: Path, cwd: Path) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        *LAUNCH,
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        str(SCRIPTS / script),
        "--out",
        str(out),
    ]
    env = clean_env(HF_HOME=str(hf_home))
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@dataclass(frozen=True)
class TwoNodes:
    """What ``launch_save_on_each_node.py`` left: per-rank facts and tensors, and each node's own disk (folder)."""

    facts: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    disks: list[Path]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> TwoNodes:
    """Two ``launch`` processes (``--num_machines 2``, one process each), each in its own working directory.

    The script's checkpoint paths are relative, so each node writes to its own folder, as on node-local disks.
    """
    root, port = tmp_path_factory.mktemp("two_nodes"), free_port()
    disks = [root / f"node{rank}_disk" for rank in (0, 1)]
    out = root / "out"
    nodes = [_start_node(r, port, "launch_save_on_each_node.py", out, root / "hf", disks[r]) for r in (0, 1)]
    wait_all(nodes, TIMEOUT, "the two launches")
    tensors = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return TwoNodes(_rank_facts(out), tensors, disks)


def test_two_machines_on_loopback_form_one_world(two_nodes: TwoNodes) -> None:
    facts = two_nodes.facts
    assert [(f["global_rank"], f["node_rank"], f["local_rank"]) for f in facts] == [(0, 0, 0), (1, 1, 0)]
    for f, disk in zip(facts, two_nodes.disks, strict=True):
        assert (f["world_size"], f["num_nodes"], f["steps"]) == (2, 2, 2)
        assert (f["distributed_type"], f["shim_distributed_type"]) == ("MULTI_CPU", "FSDP")
        assert Path(f["cwd"]) == disk


def test_checkpoint_rotation_saves_on_each_nodes_disk_only_with_save_on_each_node(two_nodes: TwoNodes) -> None:
    """CheckpointRotation (2 saves, total_limit=1): True writes and rotates on both disks, False on node 0's only."""
    node0, node1 = two_nodes.facts
    assert node0["each_node"] == node1["each_node"] == ["checkpoint_1"]  # checkpoint_0 rotated out on both disks
    assert (node0["main_only"], node1["main_only"]) == (["checkpoint_1"], [])
    assert not (two_nodes.disks[1] / "main_only").exists()
    for f in (node0, node1):
        assert f["each_node_incomplete"] == f["main_only_incomplete"] == []
        assert f["each_node_global_step"] == 2
    trained = two_nodes.tensors[0]["trained"]
    for rank, tensors in enumerate(two_nodes.tensors):  # node 1's own copy holds the trained weights too
        assert tensors["each_node"].keys() == trained.keys(), rank
        for key, value in trained.items():
            assert torch.equal(tensors["each_node"][key], value), (rank, key)
    for key, value in trained.items():
        assert torch.equal(two_nodes.tensors[0]["main_only"][key], value), key


# Sharded checkpoints with save_on_each_node=True on node-local disks: each node's folder is made whole (the shards
# of the other node's ranks and the DCP .metadata that rank 0 alone writes are sent to it before it is published).
SHARDED_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")


def sharded_files_missing(
    disk: Path, checkpoint: str, reference: Path, folders: tuple[str, ...] = SHARDED_FOLDERS
) -> dict[str, list[str]]:
    """Per DCP folder of ``checkpoint``: the files its metadata (read under ``reference``) names that ``disk`` lacks."""
    from torch.distributed.checkpoint import FileSystemReader

    missing: dict[str, list[str]] = {}
    for folder in folders:
        metadata = FileSystemReader(str(reference / checkpoint / folder)).read_metadata()
        assert metadata.storage_data, folder
        needed = {".metadata"} | {item.relative_path for item in metadata.storage_data.values()}
        missing[folder] = sorted(name for name in needed if not (disk / checkpoint / folder / name).is_file())
    return missing


def test_save_state_with_save_on_each_node_gives_each_node_a_complete_sharded_checkpoint(two_nodes: TwoNodes) -> None:
    checkpoint = "shim/checkpoints/checkpoint_0"
    for f, disk in zip(two_nodes.facts, two_nodes.disks, strict=True):
        assert f["shim_checkpoint"] == checkpoint
        assert (disk / checkpoint).is_dir()
        assert f["shim_incomplete"] == []  # published on each disk: no .checkpoint_0.incomplete left
        assert f"random_states_{f['global_rank']}.pkl" in f["shim_files"]
        assert not [name for name in f["shim_files"] if name.endswith(".receiving")]  # no partial copy left
    # node 0 holds the metadata (DCP's coordinator writes it); every disk must hold every file it names
    for disk in two_nodes.disks:
        assert sharded_files_missing(disk, checkpoint, two_nodes.disks[0]) == {
            "pytorch_model_fsdp_0": [],
            "optimizer_0": [],
        }, disk.name
    node0, node1 = two_nodes.facts
    assert node0["shim_files"] == node1["shim_files"]  # the same whole checkpoint on both disks
    for name in node0["shim_files"]:  # and byte for byte the same files
        first, second = (disk / checkpoint / name for disk in two_nodes.disks)
        assert first.read_bytes() == second.read_bytes(), name


def test_checkpoint_rotation_under_sharded_fsdp_gives_each_node_a_complete_folder(two_nodes: TwoNodes) -> None:
    """CheckpointRotation, acc_fsdp with SHARDED_STATE_DICT, save_on_each_node=True: a whole folder on each disk."""
    checkpoint = "fsdp_each_node/checkpoints/checkpoint_1"
    node0, node1 = two_nodes.facts
    assert node0["fsdp_each_node"] == node1["fsdp_each_node"] == ["checkpoint_1"]  # rotated on both disks
    for f in (node0, node1):
        assert f["fsdp_each_node_incomplete"] == []
        assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(f["fsdp_each_node_files"])
    assert node0["fsdp_each_node_files"] == node1["fsdp_each_node_files"]
    for disk in two_nodes.disks:
        assert sharded_files_missing(disk, checkpoint, two_nodes.disks[0], folders=("",)) == {"": []}, disk.name


def test_trainer_resumes_from_each_nodes_own_sharded_copy(two_nodes: TwoNodes) -> None:
    for f, tensors in zip(two_nodes.facts, two_nodes.tensors, strict=True):
        assert f["fsdp_resume_error"] is None, f["fsdp_resume_error"]
        trained, initial, loaded = tensors["fsdp_trained"], tensors["fsdp_initial"], tensors["fsdp_loaded"]
        assert trained.keys() == loaded.keys()
        assert any(not torch.equal(initial[k], v) for k, v in trained.items())  # it started elsewhere
        for key, value in trained.items():
            assert torch.equal(loaded[key], value), key


def test_load_state_from_each_nodes_disk_restores_the_saved_weights(two_nodes: TwoNodes) -> None:
    for f, tensors in zip(two_nodes.facts, two_nodes.tensors, strict=True):
        assert f["shim_load_error"] is None, f["shim_load_error"]
        saved, moved, loaded = tensors["shim_saved"], tensors["shim_moved"], tensors["shim_loaded"]
        assert saved.keys() == loaded.keys()
        assert any(not torch.equal(moved[k], v) for k, v in saved.items())  # training on changed them
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
