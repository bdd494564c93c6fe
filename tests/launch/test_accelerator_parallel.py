"""Two CPU processes (gloo): LocalSGD, ``profile`` traces, ``Accelerator(parallelism_config=...)``, ``prepare_pippy``.

One launch of ``tests/scripts/accelerator_members.py`` runs every phase for lightning_accel and, where it runs on CPU,
HF accelerate; the tests compare what each rank saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import load_rank_results, torchrun

Results = dict[str, list[dict[str, Any]]]
ATOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, Path]:
    out = tmp_path_factory.mktemp("accelerator_members")
    torchrun("accelerator_members.py", "--out", str(out), nproc=2, timeout=420)
    found = load_rank_results(out)
    assert {len(ranks) for ranks in found.values()} == {2}
    return found, out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


def test_local_sgd_matches_hf_and_ddp(results: tuple[Results, Path]) -> None:
    for rank in results[0]["local_sgd"]:
        for variant in ("ddp", "k1", "k3"):  # the same updates as HF accelerate's LocalSGD, bit for bit
            assert _max_difference(rank[f"ours_{variant}"], rank[f"hf_{variant}"]) == 0.0, variant
        assert _max_difference(rank["ours_k1"], rank["ours_ddp"]) < 1e-6  # averaging every step is DDP's SGD
        assert _max_difference(rank["ours_k3"], rank["ours_ddp"]) > 1e-3  # every 3 steps is not
    first, second = results[0]["local_sgd"]
    for variant in ("ours_k1", "ours_k3"):  # the replicas end equal (averaged at the end of the block)
        assert _max_difference(first[variant], second[variant]) == 0.0


def test_profile_writes_one_trace_per_process_as_hf(results: tuple[Results, Path]) -> None:
    found, out = results
    for rank in found["profile"]:
        assert rank["ours"] == rank["hf"] == {"files": ["profile_0.json", "profile_1.json"], "has_mm": True}
    assert '"traceEvents"' in (out / "traces_ours" / "profile_1.json").read_text()


@pytest.mark.parametrize("variant", ["model_plan", "parallelize_first"])
def test_tensor_parallel_two_processes_match_one(results: tuple[Results, Path], variant: str) -> None:
    ranks = [rank[variant] for rank in results[0]["tp"]]
    from tests.scripts.accelerator_members import STEPS, data

    x, y = data().tensors
    for index, result in enumerate(ranks):
        assert result["split"] and result["mesh_dims"] == ("tp",)
        assert result["tensor_parallel_rank"] == index
        assert result["data_parallel_rank"] == result["data_parallel_shard_rank"] == 0
        assert result["loader_batches"] == 12  # tp ranks are one data-parallel replica: the loader is not sharded
        for step, (bx, by) in enumerate(result["batches"]):  # every tp rank reads the same, unsharded batches
            torch.testing.assert_close(bx, x[4 * step : 4 * step + 4], rtol=0, atol=0)
            torch.testing.assert_close(by, y[4 * step : 4 * step + 4], rtol=0, atol=0)
        reference = result["reference"]
        assert len(result["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert _max_difference(result["weights"], reference["weights"]) < ATOL
        assert result["should_save_model"] is True
        assert result["is_fsdp2"] is False  # as in Accelerate: tensor parallelism alone is not FSDP


def test_prepare_pippy_matches_the_plain_model_and_hf(results: tuple[Results, Path]) -> None:
    first, last = results[0]["pippy"]
    for rank in (first, last):  # gathered: every process gets the last stage's output
        torch.testing.assert_close(rank["ours"], rank["plain"], rtol=0, atol=ATOL)
        assert rank["ours_split_points"] == rank["hf_last_split_points"] == ["w2"]
    assert first["ours_last"] is None and first["hf_last"] is None  # not gathered: only the last process has it
    torch.testing.assert_close(last["ours_last"], last["hf_last"], rtol=0, atol=0)
    torch.testing.assert_close(last["ours_last"], last["plain"], rtol=0, atol=ATOL)
