"""Fabric ``acc_fsdp``/``acc_parallel`` checkpoints hold stateful objects, ``load_raw`` and ``init_module`` work as in
Lightning's ``FSDPStrategy``: 2 CPU processes against Lightning's ``ddp`` (tests/scripts/fabric_fsdp_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import FSDPStrategy

from lightning_accel.precision import BF16Precision, FP32Precision
from lightning_accel.strategies import FabricAcceleratedFSDPStrategy
from tests.helpers import load_rank_results, torchrun

Results = dict[str, list[dict[str, Any]]]
SHARDED = ["fsdp2_sharded", "fsdp2_full", "fsdp1_full", "parallel", "deepspeed"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("fabric_fsdp_checkpoint")
    torchrun("fabric_fsdp_checkpoint.py", "--out", str(out), timeout=400)
    return load_rank_results(out)


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["ddp", *SHARDED])
def test_resume_restores_the_stateful_loader_and_continues_exactly(results: Results, variant: str) -> None:
    for rank in results[f"resume_{variant}"]:
        # The loader's state_dict() was saved and load_state_dict() restored it: the batches after the load are the
        # ones the uninterrupted run saw after the save, not the epoch's first ones again.
        assert torch.equal(rank["batches_after_load"], rank["batches_after_save"])
        assert not torch.equal(rank["batches_after_load"], rank["first_batches"])
        assert rank["resumed_losses"] == rank["losses"][3:]
        for key, value in rank["weights"].items():
            assert torch.equal(rank["resumed_weights"][key], value), key
        assert rank["step"] == 3
        # Nothing left over but, under DeepSpeed, the engine's own client state (Lightning's DeepSpeed code).
        assert rank["remainder"] == [] or (variant == "deepspeed" and "buffer_names" in rank["remainder"])
        assert not {"loader", "step", "model", "optimizer"} & set(rank["remainder"])


@pytest.mark.launch
@pytest.mark.parametrize("variant", SHARDED)
def test_sharded_runs_match_ddp(results: Results, variant: str) -> None:
    for ours, ddp in zip(results[f"resume_{variant}"], results["resume_ddp"], strict=True):
        assert torch.equal(ours["first_batches"], ddp["first_batches"])
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=0, atol=1e-6)
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["ddp", "fsdp2_full", "fsdp1_full", "parallel"])
def test_load_raw_puts_a_plain_state_dict_file_into_the_shards(results: Results, variant: str) -> None:
    for rank in results[f"raw_{variant}"]:
        assert rank["loaded"].keys() == rank["file"].keys()
        for key, value in rank["file"].items():
            assert torch.equal(rank["loaded"][key], value), key
        if variant != "ddp":
            directory, optimizer = rank["errors"]
            assert "`load_raw` reads one file holding a full state dict" in directory
            assert "loads an optimizer only together with its sharded model" in optimizer and "SGD" in optimizer


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["fsdp2_full", "fsdp1_full"])
def test_empty_init_is_materialized_with_reset_parameters(results: Results, variant: str) -> None:
    for rank in results[f"empty_init_{variant}"]:
        assert rank["on_meta"] and rank["is_lightning_fsdp"]
        for key, value in rank["expected"].items():
            assert torch.equal(rank["weights"][key], value), key


def test_acc_fsdp_is_a_virtual_lightning_fsdp_strategy_with_our_precision() -> None:
    assert issubclass(FabricAcceleratedFSDPStrategy, FSDPStrategy)
    assert FSDPStrategy not in FabricAcceleratedFSDPStrategy.__mro__  # nothing of Lightning's class is inherited
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_fsdp", precision="bf16-mixed")
    assert isinstance(fabric.strategy, FSDPStrategy)
    # Lightning's connector builds FSDPPrecision for an FSDPStrategy; acc_fsdp takes the equivalent of its own.
    assert isinstance(fabric.strategy.precision, BF16Precision) and fabric.strategy.precision.mode == "mixed"
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_fsdp", precision="bf16-true")
    assert isinstance(fabric.strategy.precision, BF16Precision) and fabric.strategy.precision.mode == "true"
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_fsdp")
    assert type(fabric.strategy.precision) is FP32Precision


def test_load_raw_of_a_missing_file_names_it(tmp_path: Path) -> None:
    from lightning_accel.strategies.fsdp_core import FSDPFamily

    with pytest.raises(FileNotFoundError, match=r"No state-dict file at .*absent\.pt"):
        FSDPFamily(None).load_raw_module(tmp_path / "absent.pt", torch.nn.Linear(2, 2))


def test_loading_into_neither_a_module_nor_a_state_names_both_calls() -> None:
    from lightning_accel.strategies.fsdp_core import load_target_error

    message = load_target_error("acc_fsdp", None)
    assert "fabric.load(path, {'model': model, ...})" in message and "fabric.load_raw(path, model)" in message
    assert message.endswith("got None.")
