"""Completing a checkpoint folder on each node's disk (``save_on_each_node`` on node-local storage).

The plan is checked as a pure function; the transfers on 2 processes of one node (torchrun, gloo), with one folder
per rank standing in for each node's disk, one shared folder, and a failing write. Two real loopback "nodes" with
their own working directories are in ``tests/launch/test_cli_launch.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint.node_copies import FileCopy, complete_on_each_node, list_files, plan_copies
from tests.helpers import load_rank_results, torchrun


def test_plan_sends_each_missing_file_from_the_lowest_rank_that_has_it() -> None:
    listings = [
        {".metadata": 10, "__0_0.distcp": 5, "common": 1},
        None,  # not a node's local main process
        {"__2_0.distcp": 6, "common": 1},
        {"__3_0.distcp": 7, "__2_0.distcp": 6, "common": 1},
    ]
    assert plan_copies(listings) == [
        FileCopy(".metadata", 10, 0, (2, 3)),
        FileCopy("__0_0.distcp", 5, 0, (2, 3)),
        FileCopy("__2_0.distcp", 6, 2, (0,)),
        FileCopy("__3_0.distcp", 7, 3, (0, 2)),
    ]


def test_plan_is_empty_when_the_listings_agree_or_one_node_lists() -> None:
    same = {".metadata": 10, "__0_0.distcp": 5, "__1_0.distcp": 5}
    assert plan_copies([same, None, dict(same), None]) == []  # shared storage seen by two nodes
    assert plan_copies([{"a": 1}, None]) == []  # one node
    assert plan_copies([None, None]) == []


def test_list_files_is_relative_and_skips_links_and_partial_copies(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"")
    (tmp_path / ".b.1.receiving").write_bytes(b"partial")
    (tmp_path / "link").symlink_to(tmp_path / "b")
    assert list_files(tmp_path) == {"sub/a": 3, "b": 0}
    assert list_files(tmp_path / "missing") == {}
    assert list_files(tmp_path / "b") == {}


def test_without_a_process_group_nothing_is_copied(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    assert complete_on_each_node(tmp_path, node_manager=True) == []


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("node_copies")
    torchrun("node_copies.py", "--out", str(out), timeout=240)
    return load_rank_results(out)


@pytest.mark.launch
def test_each_disk_receives_the_files_it_lacks_in_chunks(run: dict[str, list[dict[str, Any]]]) -> None:
    first, second = run["local"]
    assert (
        first["plan"]
        == second["plan"]
        == [
            ("empty", 0, 0, (1,)),
            ("shard/.metadata", 3005, 0, (1,)),  # 4 messages of at most 1000 bytes
            ("shard/__0_0.distcp", 2560, 0, (1,)),
            ("shard/__1_0.distcp", 5120, 1, (0,)),
        ]
    )
    assert first["contents"] == second["contents"]  # byte for byte
    assert sorted(first["contents"]) == [
        "common.txt",
        "empty",
        "shard/.metadata",
        "shard/__0_0.distcp",
        "shard/__1_0.distcp",
    ]


@pytest.mark.launch
def test_shared_storage_and_one_node_copy_nothing(run: dict[str, list[dict[str, Any]]]) -> None:
    for result in run["shared"]:
        assert result["plan"] == []
        assert result["contents"] == result["before"]
    assert [r["plan"] for r in run["one_node"]] == [[], []]


@pytest.mark.launch
def test_a_failed_write_raises_on_every_process(run: dict[str, list[dict[str, Any]]]) -> None:
    first, second = run["failure"]
    assert first["error"] is not None and second["error"] == first["error"]  # rank 0's error, on both ranks
    assert first["error"].startswith("NotADirectoryError") and "x.bin/inner" in first["error"]  # its first one
    assert any("raised on process 0 during the failure case" in note for note in second["notes"])


@pytest.mark.launch
def test_a_failed_read_leaves_no_file_and_raises_on_every_process(run: dict[str, list[dict[str, Any]]]) -> None:
    first, second = run["sender_failure"]
    assert first["error"] is not None and second["error"] == first["error"]
    assert "shrank while it was sent" in first["error"]
    assert (first["files"], second["files"]) == (["shard.distcp"], [])  # nothing half-received on rank 1's disk


@pytest.mark.launch
def test_save_state_on_one_node_with_save_on_each_node_copies_nothing_and_loads(
    run: dict[str, list[dict[str, Any]]],
) -> None:
    for result in run["save_state"]:
        assert result["plans"] == [[]]  # one save, one shared folder: nothing to send
        assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "random_states_1.pkl"} <= set(
            result["files"]
        )
        assert {"pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"} <= set(result["files"])
        saved, moved, loaded = result["saved"], result["moved"], result["loaded"]
        assert any(not torch.equal(moved[k], v) for k, v in saved.items())
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
