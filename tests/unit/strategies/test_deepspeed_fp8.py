"""fp8 under acc_deepspeed: float8 Linears inside a DeepSpeed engine that trains in bf16 (Accelerate's way).

On CPU the strategies refuse fp8 like every other strategy does; the conversion, the config reconciliation and the
engine itself are exercised on 2 CPU processes by ``tests/scripts/deepspeed_fp8.py`` (torch's CPU ``_scaled_mm`` runs
torchao's float8 matmuls). The Trainer and Fabric runs on a GPU are in ``tests/launch/test_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_accel  # noqa: F401
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.precision import FP8Precision
from lightning_accel.strategies.deepspeed_core import TrainingFacts, resolve_config
from lightning_accel.strategies.deepspeed_fp8 import (
    FabricFP8DeepSpeedPrecision,
    TrainerFP8DeepSpeedPrecision,
    facts_precision,
)
from tests.helpers import load_rank_results, torchrun

pytest.importorskip("deepspeed")
pytest.importorskip("torchao")


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_fp8_on_cpu_is_refused_under_deepspeed_too(make: type) -> None:
    with pytest.raises(ValueError, match=r"fp8 training needs an NVIDIA GPU with compute capability >= 8.9.*'cpu'"):
        make(accelerator="cpu", devices=1, strategy="acc_deepspeed", plugins=[FP8Precision()])


def test_fp8_plugin_becomes_deepspeed_bf16_with_the_float8_conversion() -> None:
    from lightning.fabric.plugins.precision import DeepSpeedPrecision as FabricDeepSpeedPrecision
    from lightning.pytorch.plugins import DeepSpeedPrecision
    from torchao.float8.float8_linear import Float8Linear

    from lightning_accel.strategies.precision_adoption import _as_deepspeed

    fp8 = FP8Precision()
    trainer_side = _as_deepspeed(fp8, DeepSpeedPrecision)
    assert type(trainer_side) is TrainerFP8DeepSpeedPrecision and trainer_side.fp8 is fp8
    assert type(_as_deepspeed(fp8, FabricDeepSpeedPrecision)) is FabricFP8DeepSpeedPrecision
    # Lightning sees DeepSpeed's "bf16-mixed"; the config reconciliation sees "fp8".
    assert trainer_side.precision == "bf16-mixed"
    assert facts_precision(trainer_side) == "fp8"
    assert facts_precision(DeepSpeedPrecision("bf16-mixed")) == "bf16-mixed"
    model = network()
    weights = [p for p in model.parameters()]
    converted = trainer_side.convert_module(model)
    # Accelerate's default filter: the first and last Linear stay in high precision; parameters are kept (optimizers
    # built before the conversion still hold them).
    assert [type(m) is Float8Linear for m in converted if isinstance(m, nn.Linear)] == [False, True, False]
    assert all(a is b for a, b in zip(weights, converted.parameters(), strict=True))
    with trainer_side.forward_context():  # torchao needs no context of its own, and DeepSpeed casts, not autocast
        assert not torch.is_autocast_enabled("cpu")


def test_fp8_enables_deepspeed_bf16_and_refuses_an_fp16_config() -> None:
    facts = TrainingFacts(world_size=1, device_type="cpu", precision="fp8", micro_batch_size=8)
    config = resolve_config(DeepSpeedPlugin().deepspeed_config, facts)
    assert config["bf16"] == {"enabled": True}
    assert not (config.get("fp16") or {}).get("enabled")
    fp16_config = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    with pytest.raises(
        ValueError, match=r"fp16.enabled=True, but the precision is 'fp8' \(fp8 runs DeepSpeed in bf16\)"
    ):
        resolve_config(fp16_config.deepspeed_config, facts)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("deepspeed_fp8")
    torchrun("deepspeed_fp8.py", "--out", str(out), timeout=300)
    return load_rank_results(out)


@pytest.mark.launch
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_gets_float8_linears_and_trains_in_bf16(engines: dict[str, list[dict[str, Any]]], stage: int) -> None:
    for rank in engines[f"fp8_stage{stage}"]:
        assert rank["precision_class"] == "TrainerFP8DeepSpeedPrecision"
        assert rank["float8_linears"] == ["2"]
        assert rank["param_dtypes"] == ["torch.bfloat16"]
        assert (rank["bf16"], rank["fp16"]) == (True, False)
        assert rank["losses"][-1] < 0.6 * rank["losses"][0]


@pytest.mark.launch
def test_float8_matmuls_change_the_numbers_but_track_bf16(engines: dict[str, list[dict[str, Any]]]) -> None:
    for fp8, bf16, stage3 in zip(engines["fp8_stage2"], engines["bf16_stage2"], engines["fp8_stage3"], strict=True):
        assert bf16["float8_linears"] == []
        assert fp8["losses"] != bf16["losses"]
        torch.testing.assert_close(torch.tensor(fp8["losses"]), torch.tensor(bf16["losses"]), atol=0.01, rtol=0.02)
        # ZeRO 3 partitions the Float8Linear weights and gathers them for the forward: the same numbers as ZeRO 2.
        assert stage3["losses"] == fp8["losses"]
