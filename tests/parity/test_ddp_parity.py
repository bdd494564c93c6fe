"""2 CPU processes (gloo): lightning_accel's DDP strategies against Lightning's own ``ddp``, Trainer and Fabric."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import load_rank_results, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

SAME_AS_DDP = ["acc_multi_cpu", "acc_ddp", "acc_kwargs"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("ddp_parity")
    torchrun("ddp_parity.py", "--out", str(out), timeout=400)
    found = load_rank_results(out)
    return found


def assert_same_run(ours: list[dict[str, Any]], reference: list[dict[str, Any]], atol: float = 0.0) -> None:
    for rank, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert len(a["losses"]) == 6, rank
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=0, atol=atol)
        for key, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][key], rtol=0, atol=atol, msg=f"rank {rank} {key}")


@pytest.mark.parametrize("variant", SAME_AS_DDP)
def test_trainer_strategy_matches_lightning_ddp(results: dict[str, list[dict[str, Any]]], variant: str) -> None:
    ours = results[variant]
    assert [r["strategy_class"] for r in ours] == ["AcceleratedDDPStrategy"] * 2
    assert [r["world_size"] for r in ours] == [2, 2]
    assert {r["backend"] for r in ours} == {"gloo"}
    assert {r["distributed_type"] for r in ours} == {"DistributedType.MULTI_CPU"}
    assert_same_run(ours, results["ddp"], atol=1e-6)


def test_ranks_saw_different_data_and_weights_stayed_in_sync(results: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = results["acc_multi_cpu"]
    assert rank0["losses"] != rank1["losses"]
    for key, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][key]), key


def test_ddp_kwargs_reach_distributed_data_parallel(results: dict[str, list[dict[str, Any]]]) -> None:
    tuned, default = results["acc_kwargs"][0], results["acc_multi_cpu"][0]
    assert tuned["bucket_bytes_cap"] == 1 * 1024 * 1024
    assert tuned["gradient_as_bucket_view"] is True
    assert default["bucket_bytes_cap"] == 25 * 1024 * 1024
    assert default["gradient_as_bucket_view"] is False


def test_fabric_strategy_matches_fabric_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    ours = results["fabric_acc_multi_cpu"]
    assert [r["strategy_class"] for r in ours] == ["FabricAcceleratedDDPStrategy"] * 2
    assert_same_run(ours, results["fabric_ddp"], atol=1e-6)
    # Fabric's manual loop and the Trainer see the same data, model and optimizer.
    assert_same_run(ours, results["ddp"], atol=1e-6)


def test_fp16_comm_hook_is_registered_and_compresses(results: dict[str, list[dict[str, Any]]]) -> None:
    hooked, plain = results["acc_fp16_hook"], results["ddp"]
    assert [r["comm_hooks"] for r in hooked] == [1, 1]
    assert [r["comm_hooks"] for r in plain] == [0, 0]
    # fp16 all-reduce rounds the gradients: close to plain DDP, but not bitwise equal.
    assert_same_run(hooked, plain, atol=1e-3)
    assert hooked[0]["losses"] != plain[0]["losses"]


def test_power_sgd_hook_approximates_gradients_after_its_start_iteration(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    hooked, plain = results["acc_power_sgd"], results["ddp"]
    assert [r["comm_hooks"] for r in hooked] == [1, 1]
    # PowerSGD all-reduces exactly (here in fp16, through the wrapper) until start_powerSGD_iter=2, then compresses.
    torch.testing.assert_close(
        torch.tensor(hooked[0]["losses"][:3]), torch.tensor(plain[0]["losses"][:3]), atol=1e-4, rtol=0
    )
    assert abs(hooked[0]["losses"][-1] - plain[0]["losses"][-1]) > 1e-3
    for key, value in hooked[0]["weights"].items():
        assert torch.equal(value, hooked[1]["weights"][key]), key
