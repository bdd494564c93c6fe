"""2 CPU processes (gloo): the three callbacks composed on one Trainer, stopped and resumed exactly.

One ``torch.distributed.run`` launch per strategy runs every scenario of ``tests/scripts/callbacks_resume.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_utilities.core.imports import module_available

from tests.helpers import load_rank_results, torchrun
from tests.scripts.callbacks_resume import BATCH_SIZE, DATA_SEED, MAX_EPOCHS, NUM_SAMPLES, TOTAL_LIMIT

# Every strategy listed here gets the full set of checks below (one 2-process launch each, ~25-35 s on 2 cores).
STRATEGIES = [
    "acc_multi_cpu",
    "acc_fsdp",
    pytest.param("acc_deepspeed", marks=pytest.mark.skipif(not module_available("deepspeed"), reason="no deepspeed")),
]

Runs = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=STRATEGIES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out: Path = tmp_path_factory.mktemp(f"callbacks_{request.param}")
    torchrun("callbacks_resume.py", "--strategy", request.param, "--out", str(out), timeout=400)
    found = load_rank_results(out)
    return found


def assert_same_weights(resumed: dict[str, Any], uninterrupted: dict[str, Any]) -> None:
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize(
    ("scenario", "reference", "stopped_at_step"),
    [("epoch_boundary", "full", 3), ("mid_epoch", "full", 4), ("carry_mid_epoch", "carry_full", 3)],
)
def test_stop_and_resume_equals_uninterrupted_run_bit_for_bit(
    runs: Runs, scenario: str, reference: str, stopped_at_step: int
) -> None:
    for rank, (resumed, uninterrupted) in enumerate(zip(runs[scenario], runs[reference], strict=True)):
        assert resumed["first"]["global_step"] == stopped_at_step, rank
        assert resumed["global_step"] == uninterrupted["global_step"], rank
        assert_same_weights(resumed, uninterrupted)
        # Same batches, same order, same dropout masks: every loss after the restart matches.
        tail = uninterrupted["seen"][-len(resumed["seen"]) :]
        assert resumed["seen"] == tail, rank
        assert resumed["steps"] == uninterrupted["steps"][stopped_at_step:], rank


def test_scenarios_are_not_trivially_equal(runs: Runs) -> None:
    """The scenarios are sensitive: the first part alone ends elsewhere, and the ranks agree on the weights."""
    resumed, uninterrupted = runs["mid_epoch"][0], runs["full"][0]
    assert any(not torch.equal(resumed["first"]["weights"][k], v) for k, v in uninterrupted["weights"].items())
    rank0, rank1 = runs["full"]
    for key, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][key]), key


def test_accumulation_steps_after_batches_1_3_and_4_of_every_epoch(runs: Runs) -> None:
    for rank_run in runs["full"]:
        steps = [(epoch, batch) for epoch, batch, _ in rank_run["steps"]]
        assert steps == [(e, b) for e in range(MAX_EPOCHS) for b in (1, 3, 4)]


def test_windows_carry_across_epochs_without_sync_with_dataloader(runs: Runs) -> None:
    for rank_run in runs["carry_full"]:
        steps = [(epoch, batch) for epoch, batch, _ in rank_run["steps"]]
        # 5 batches per epoch: every second batch overall steps, so windows straddle epoch boundaries.
        assert steps == [(0, 1), (0, 3), (1, 0), (1, 2), (1, 4), (2, 1), (2, 3)]


def test_step_interval_scheduler_steps_once_per_optimizer_step(runs: Runs) -> None:
    lrs = [lr for _, _, lr in runs["full"][0]["steps"]]
    expected = [0.05 * 0.7 ** (i // 2) for i in range(len(lrs))]
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor(expected), rtol=1e-12, atol=0)


def test_sampler_deals_accelerates_seedable_order_like_batch_sampler_shard(runs: Runs) -> None:
    accelerate = pytest.importorskip("accelerate.data_loader")
    seen = {rank: run["seen"] for rank, run in enumerate(runs["full"])}
    for epoch in range(MAX_EPOCHS):
        for rank in (0, 1):
            # SeedableRandomSampler moves to the next epoch after each full pass: one per rank.
            sampler = accelerate.SeedableRandomSampler(range(NUM_SAMPLES), data_seed=DATA_SEED)
            sampler.set_epoch(epoch)
            batches = torch.utils.data.BatchSampler(sampler, BATCH_SIZE, drop_last=False)
            expected = list(accelerate.BatchSamplerShard(batches, num_processes=2, process_index=rank))
            got = [indices for e, _, indices, _ in seen[rank] if e == epoch]
            assert got == expected, (epoch, rank)


def test_ranks_see_disjoint_data_covering_each_epoch_in_a_new_order(runs: Runs) -> None:
    orders = []
    for epoch in range(MAX_EPOCHS):
        per_rank = [[i for e, _, batch, _ in run["seen"] if e == epoch for i in batch] for run in runs["full"]]
        both = per_rank[0] + per_rank[1]
        assert set(both) == set(range(NUM_SAMPLES)), epoch
        # Accelerate pads the last round with the epoch's first samples: 38 samples fill 2 x 5 x 4 = 40 slots, so
        # exactly 2 samples are seen twice; all others once, by one rank.
        assert len(both) == 40
        assert sorted(i for i in set(both) if both.count(i) > 1) == sorted(_first_samples(epoch, 2))
        orders.append(per_rank[0])
    assert orders[0] != orders[1] != orders[2]


def _first_samples(epoch: int, count: int) -> list[int]:
    order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(DATA_SEED + epoch)).tolist()
    return order[:count]


def test_rotation_keeps_numbering_and_limit_across_resume(runs: Runs) -> None:
    for rank_run in runs["mid_epoch"]:
        # 4 steps before the stop (checkpoints 0-3), 5 after: numbering continues at 4 and ends at 8.
        assert rank_run["first"]["checkpoints"] == ["checkpoint_2", "checkpoint_3"]
        assert rank_run["checkpoints"] == ["checkpoint_7", "checkpoint_8"]
        assert rank_run["iteration"] == 9
        assert len(rank_run["checkpoints"]) == TOTAL_LIMIT


def strategy_of(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params["runs"])


def local_first_micro_batch_grads(runs: Runs) -> list[torch.Tensor]:
    """Each rank's own first-micro-batch gradient in the reference run (Lightning's ddp, accumulate_grad_batches=2)."""
    local = runs["sync_reference"][0]["first_micro_batch_grads"]
    assert all(g is not None for g in local)
    assert not torch.allclose(local[0], local[1])  # the ranks' data differ: averaging them changes the gradient
    return local


def test_sync_each_batch_averages_the_first_micro_batch_like_ddp(runs: Runs, request: pytest.FixtureRequest) -> None:
    local = local_first_micro_batch_grads(runs)
    if strategy_of(request) == "acc_deepspeed":
        # block_backward_sync is DeepSpeed's step signal and stays: ZeRO-2 reduces the first micro-batch into its
        # partitions but opens them only at the boundary (a boundary there would close the window and drop it).
        assert runs["sync_each_batch"][0]["first_micro_batch_grads"] == [None, None]
        return
    expected = (local[0] + local[1]) / 2
    for rank, grad in enumerate(runs["sync_each_batch"][0]["first_micro_batch_grads"]):
        assert grad is not None, rank
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-7, msg=f"rank {rank}")


def test_without_sync_each_batch_the_first_micro_batch_stays_local(runs: Runs, request: pytest.FixtureRequest) -> None:
    local = local_first_micro_batch_grads(runs)
    got = runs["no_sync"][0]["first_micro_batch_grads"]
    if strategy_of(request) in ("acc_fsdp", "acc_deepspeed"):
        # FSDP2 and ZeRO keep gradients inside an accumulation window in their own buffers, out of `.grad`.
        assert got == [None, None]
        return
    for rank, grad in enumerate(got):
        torch.testing.assert_close(grad, local[rank], rtol=0, atol=0, msg=f"rank {rank}")


@pytest.mark.parametrize("scenario", ["sync_each_batch", "no_sync"])
def test_one_step_over_two_micro_batches_gives_ddps_weights(
    runs: Runs, scenario: str, request: pytest.FixtureRequest
) -> None:
    for rank, (ours, reference) in enumerate(zip(runs[scenario], runs["sync_reference"], strict=True)):
        assert (ours["global_step"], ours["micro_batches"]) == (reference["global_step"], reference["micro_batches"])
        assert reference["micro_batches"] == 2
        assert ours["weights"].keys() == reference["weights"].keys()
        for key, value in reference["weights"].items():
            torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=1e-6, msg=f"rank {rank} {key}")


@pytest.mark.parametrize("scenario", ["sync_each_batch", "no_sync"])
def test_deepspeed_reaches_its_accumulation_boundary_on_the_stepping_micro_batch_only(
    runs: Runs, scenario: str, request: pytest.FixtureRequest
) -> None:
    """sync_each_batch keeps DeepSpeed's boundary where the optimizer steps: at the second micro-batch, not the first.

    At a boundary ZeRO replaces the gradients it reduced since the previous one, so a first micro-batch at the boundary
    would be dropped from the step (the update would equal the second micro-batch's gradient alone).
    """
    if strategy_of(request) != "acc_deepspeed":
        pytest.skip("DeepSpeed's accumulation boundary")
    for rank, run in enumerate(runs[scenario]):
        assert run["boundaries"] == [False, True], rank
