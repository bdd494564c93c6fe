"""``acc_fsdp``/``acc_parallel``'s FSDP2 wrapping (:func:`lightning_accel.utils.fsdp_utils.apply_fsdp2`) against HF's.

One torchrun launch of ``tests/scripts/fsdp2_apply_parity.py`` (2 CPU processes, gloo) prepares the same model with
``FSDPFamily.wrap`` and with HF accelerate 1.15's ``fsdp2_apply_ac`` + ``fsdp2_prepare_model``, per plugin variant:
the FSDP2 units and their resharding, every submodule's class (checkpoint and offload wrappers), each parameter's
placement, local shape, dtype and device, and the losses and weights of three AdamW steps must be the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import load_rank_results, torchrun
from tests.scripts.fsdp_utils_parity import Net

pytestmark = pytest.mark.launch  # every test here starts processes

pytest.importorskip("accelerate.utils.fsdp_utils")

VARIANTS = [
    "checkpointing",
    "checkpointing_offload",
    "ram_efficient",
    "size_based",
    "tied",
    "no_reshard",
    "ignored",
    "bf16_policy",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("fsdp2_apply")
    torchrun("fsdp2_apply_parity.py", "--out", str(out), timeout=400)
    return load_rank_results(out)


def _same_tensors(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rank", [0, 1])
def test_wraps_trains_as_hf(results: dict[str, list[dict[str, Any]]], variant: str, rank: int) -> None:
    mine, theirs = results[variant][rank]["ours"], results[variant][rank]["hf"]
    assert mine["units"] == theirs["units"]
    assert mine["classes"] == theirs["classes"]
    assert mine["params"] == theirs["params"]
    _same_tensors(mine["start"], theirs["start"])
    assert mine["losses"] == theirs["losses"]
    _same_tensors(mine["end"], theirs["end"])


def test_the_variants_exercise_what_they_name(results: dict[str, list[dict[str, Any]]]) -> None:
    """Guards the comparison above against variants that would agree by doing nothing."""
    classes = {variant: set(results[variant][0]["ours"]["classes"].values()) for variant in VARIANTS}
    assert {"FSDPCheckpointWrapper", "OffloadWrapper"} <= classes["checkpointing_offload"]
    assert "FSDPCheckpointWrapper" in classes["checkpointing"] and "OffloadWrapper" not in classes["checkpointing"]
    units = results["checkpointing"][0]["ours"]["units"]
    assert units["embed"] is True and units["final_norm"] is False and units["head"] is False  # embedding, tail
    tied = results["tied"][0]["ours"]
    assert tied["units"]["embed"] is False and "head.weight" not in tied["params"]  # the tied head joins the tail
    assert results["no_reshard"][0]["ours"]["units"]["blocks.0"] is False
    assert results["ignored"][0]["ours"]["params"]["final_norm.weight"][0] is None  # not a DTensor
    assert results["bf16_policy"][0]["ours"]["losses"] != results["checkpointing"][0]["ours"]["losses"]
    # Process 1 built other weights than process 0: efficient loading gives everyone process 0's, plain sharding
    # keeps each process's own shard.
    torch.manual_seed(0)
    process_zero = Net().state_dict()
    _same_tensors(results["ram_efficient"][1]["ours"]["start"], process_zero)
    mixed = results["checkpointing"][1]["ours"]["start"]
    assert any(not torch.equal(mixed[k], process_zero[k]) for k in process_zero)
