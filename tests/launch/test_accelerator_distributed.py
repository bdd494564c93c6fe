"""The Accelerator's collectives, sync control and gather_for_metrics on 2 CPU processes (one torchrun launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("accelerator_ops")
    torchrun("accelerator_ops.py", "--out", str(out), timeout=240)
    return [torch.load(out / f"ops_rank{r}.pt", weights_only=False) for r in range(2)]


def test_process_information(ranks: list[dict[str, Any]]) -> None:
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert {r["distributed_type"] for r in ranks} == {"DistributedType.MULTI_CPU"}
    assert [r["use_distributed"] for r in ranks] == [True, True]
    assert [(r["is_main_process"], r["is_last_process"]) for r in ranks] == [(True, False), (False, True)]


def test_gather_concatenates_on_dim_0(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["gather"] == [0.0, 0.0, 1.0, 1.0]
        assert r["gather_scalar"] == [0, 1]
        assert r["gather_nested"] == {"a": [[0.0, 0.0, 1.0, 1.0]]}
        assert r["gather_object"] == ["r0", "r1"]


def test_broadcast_from_another_process(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["broadcast"] == [6.0]
        assert r["broadcast_object_list"] == [0, "x"]  # from process 0 by default


def test_reduce_defaults(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["reduce_sum"] == 3.0  # Accelerator.reduce sums by default
        assert r["reduce_mean"] == 1.5  # utils.reduce averages by default
        assert r["reduce_max"] == 2.0


def test_pad_across_processes(ranks: list[dict[str, Any]]) -> None:
    assert [r["pad"] for r in ranks] == [[1.0, 0.0], [1.0, 2.0]]
    assert [r["pad_first"] for r in ranks] == [[-1.0, 1.0], [1.0, 2.0]]


def test_no_sync_keeps_local_gradients(ranks: list[dict[str, Any]]) -> None:
    assert [r["no_sync_grad"] for r in ranks] == [[[1.0, 1.0]], [[2.0, 2.0]]]
    # After zero_grad, a synchronised backward averages the ranks' gradients: (1 + 2) / 2.
    assert [r["synced_grad"] for r in ranks] == [[[1.5, 1.5]], [[1.5, 1.5]]]


def test_gather_for_metrics_returns_each_sample_once(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["batches"] == 2
        assert sorted(r["metric_samples"]) == [float(i) for i in range(11)]


def test_main_process_first(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["order"] == ["0", "1"]


def test_split_between_processes(ranks: list[dict[str, Any]]) -> None:
    assert [r["split"] for r in ranks] == [["A", "B"], ["C"]]
    assert [r["padded"] for r in ranks] == [["A", "B"], ["C", "C"]]
    assert [r["split_dict"] for r in ranks] == [
        {"x": [0, 1, 2], "y": [0, 1, 2]},
        {"x": [3, 4, 4], "y": [3, 4, 4]},
    ]


def test_process_decorators(ranks: list[dict[str, Any]]) -> None:
    assert [r["decorated"] for r in ranks] == [["main", None, None], [None, "one", "last"]]


def test_trigger_set_on_one_process_is_seen_by_all_once(ranks: list[dict[str, Any]]) -> None:
    assert [r["triggered"] for r in ranks] == [[True, False], [True, False]]


def test_device_specific_seeds_then_synchronised_generators(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["seeded"] != ranks[1]["seeded"]
    assert ranks[0]["synced"] == ranks[1]["synced"]


def test_debug_mode_reports_shape_mismatches_instead_of_hanging(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["debug"] is True
        assert "gather needs the same shapes" in r["mismatch"]
        assert "process 0: [1]" in r["mismatch"] and "process 1: [2]" in r["mismatch"]
