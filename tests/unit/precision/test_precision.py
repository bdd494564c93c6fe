"""Precision plugins: what each one really does on CPU, Lightning's strings under acc_* strategies, and the errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401
from lightning_accel.precision import (
    BF16Precision,
    FP8Precision,
    FP16Precision,
    FP32Precision,
    precision_plugin,
)
from lightning_accel.strategies import AcceleratedFSDPStrategy, FabricAcceleratedFSDPStrategy
from lightning_accel.utils import AutocastKwargs, FullyShardedDataParallelPlugin, PrecisionType
from tests.helpers import load_rank_results, torchrun

FLAGS = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Probe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.activation_dtypes: list[torch.dtype] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.net[0](batch[0])
        self.activation_dtypes.append(hidden.dtype)
        loss = nn.functional.mse_loss(self.net[2](hidden.relu()).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(**trainer_kwargs: Any) -> tuple[L.Trainer, Probe]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    module = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, **FLAGS, **trainer_kwargs)
    trainer.fit(module, DataLoader(data, batch_size=8))
    return trainer, module


@pytest.mark.parametrize(
    ("kwargs", "plugin", "activation"),
    [
        ({"precision": "bf16-mixed"}, BF16Precision, torch.bfloat16),
        ({"plugins": [BF16Precision()]}, BF16Precision, torch.bfloat16),
        ({"plugins": [BF16Precision(autocast_kwargs=AutocastKwargs(enabled=False))]}, BF16Precision, torch.float32),
        ({"precision": "bf16-true"}, BF16Precision, torch.bfloat16),
        ({"precision": "32-true"}, FP32Precision, torch.float32),
    ],
)
def test_acc_no_adopts_lightning_strings_and_plugins(kwargs: dict[str, Any], plugin: type, activation: Any) -> None:
    trainer, module = fit(strategy="acc_no", **kwargs)
    assert type(trainer.strategy.precision_plugin) is plugin
    assert set(module.activation_dtypes) == {activation}
    weights = module.net[0].weight.dtype
    assert weights == (torch.bfloat16 if kwargs.get("precision") == "bf16-true" else torch.float32)


def test_fp32_plugin_trains_exactly_like_lightning_default() -> None:
    _, ours = fit(strategy="acc_no", plugins=[FP32Precision()])
    _, plain = fit(strategy="single_device")
    assert ours.losses == plain.losses
    assert torch.equal(ours.net[0].weight, plain.net[0].weight)


def test_bf16_autocast_changes_numbers_but_trains_close_to_fp32() -> None:
    _, bf16 = fit(strategy="acc_no", precision="bf16-mixed")
    _, fp32 = fit(strategy="acc_no")
    assert bf16.losses != fp32.losses
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(fp32.losses), atol=0.05, rtol=0.05)


def test_one_plugin_class_serves_fabric() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_no", precision="bf16-mixed")
    assert type(fabric.strategy.precision) is BF16Precision
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = net.weight.detach().clone()
    output = model(torch.randn(2, 8))
    assert output.dtype == torch.bfloat16
    fabric.backward(output.float().pow(2).mean())
    optimizer.step()
    assert not torch.equal(before, net.weight)
    assert fabric.strategy.precision.step_was_skipped is False


def test_precision_plugin_builds_every_type_and_refuses_unknown_names() -> None:
    assert type(precision_plugin("no")) is FP32Precision
    assert type(precision_plugin(PrecisionType.BF16)) is BF16Precision
    assert precision_plugin("bf16").compute_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"Unknown precision 'fp64'; expected one of \['no', 'fp8', 'fp16', 'bf16'\]"):
        precision_plugin("fp64")


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_fp16_on_cpu_is_refused_with_bf16_suggestion(make: type) -> None:
    with pytest.raises(ValueError, match=r"fp16 mixed precision needs a GPU.*Use bf16 on CPU"):
        make(accelerator="cpu", devices=1, strategy="acc_no", plugins=[FP16Precision()])
    with pytest.raises(ValueError, match=r"fp16 mixed precision needs a GPU"):
        FP16Precision(device="cpu")


def test_fp8_needs_its_backend_and_a_recent_gpu() -> None:
    # Without torchao (an optional extra) construction names it; with it (the test extra installs it) CPU is refused.
    try:
        plugin = FP8Precision()
    except ModuleNotFoundError as err:
        assert "torchao" in str(err) and "lightning-accel[fp8]" in str(err)
    else:
        with pytest.raises(ValueError, match=r"fp8 training needs an NVIDIA GPU"):
            plugin.bind("cpu")
    with pytest.raises(ValueError, match=r"FP8Precision\(backend='xla'\) is unknown; use 'ao'"):
        FP8Precision(backend="xla")  # type: ignore[arg-type]


def test_bad_plugin_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mode must be 'mixed' \(autocast\) or 'true'"):
        BF16Precision(mode="half")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`autocast_kwargs` must be an AutocastKwargs, got dict"):
        BF16Precision(autocast_kwargs={"enabled": False})  # type: ignore[arg-type]


def fsdp_side(make: type, version: int, precision: str) -> tuple[Any, Any]:
    """The strategy and precision plugin a Trainer or Fabric ends up with under acc_fsdp (nothing is launched)."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    if make is L.Trainer:
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=AcceleratedFSDPStrategy(plugin), precision=precision, **FLAGS
        )
        return trainer.strategy, trainer.strategy.precision_plugin
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricAcceleratedFSDPStrategy(plugin), precision=precision)
    return fabric.strategy, fabric.strategy.precision


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("precision", "plugin", "mode", "fsdp_dtype"),
    [
        ("32-true", FP32Precision, "mixed", None),
        ("bf16-mixed", BF16Precision, "mixed", torch.bfloat16),
        ("bf16-true", BF16Precision, "true", None),
        ("16-true", FP16Precision, "true", None),
    ],
)
def test_acc_fsdp_adopts_lightning_strings(
    make: type, version: int, precision: str, plugin: type, mode: str, fsdp_dtype: torch.dtype | None
) -> None:
    strategy, adopted = fsdp_side(make, version, precision)
    assert type(adopted) is plugin and adopted.mode == mode and adopted.device == "cpu"
    # Only autocast ("-mixed") sets FSDP's mixed-precision policy; "-true" casts the weights before sharding.
    policy = strategy._fsdp._mixed_precision(adopted)
    assert (None if policy is None else (policy.param_dtype, policy.reduce_dtype)) == (
        None if fsdp_dtype is None else (fsdp_dtype, fsdp_dtype)
    )


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_acc_fsdp_16_mixed_on_cpu_is_lightnings_bf16_and_the_fp16_plugin_is_refused(make: type) -> None:
    # Lightning rewrites "16-mixed" on CPU to "bf16-mixed" (with a warning) before the strategy sees it.
    with pytest.warns(UserWarning, match=r"AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`"):
        _, adopted = fsdp_side(make, 2, "16-mixed")
    assert type(adopted) is BF16Precision
    with pytest.raises(ValueError, match=r"fp16 mixed precision needs a GPU.*Use bf16 on CPU"):
        make(accelerator="cpu", devices=2, strategy="acc_fsdp", plugins=[FP16Precision()])


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize("version", [1, 2])
def test_acc_fsdp_16_mixed_on_a_gpu_is_fp16_autocast_with_an_fp16_policy(version: int) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_accel.precision import from_lightning
    from lightning_accel.strategies.fsdp_core import FSDPFamily

    # What the strategy's precision property makes of Lightning's "16-mixed" plugin on a GPU (CUDA needs no GPU here).
    adopted = from_lightning(MixedPrecision("16-mixed", "cuda"))
    assert type(adopted) is FP16Precision and adopted.device == "cuda" and adopted.scaler is not None
    policy = FSDPFamily(FullyShardedDataParallelPlugin(fsdp_version=version))._mixed_precision(adopted)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float16)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: Path = tmp_path_factory.mktemp("precision")
    torchrun("precision_check.py", "--out", str(out), timeout=300)
    found = load_rank_results(out)
    return found


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["acc_multi_cpu", "fsdp2", "fsdp1"])
def test_bf16_mixed_autocasts_on_two_cpu_processes(distributed: dict[str, Any], variant: str) -> None:
    for rank in distributed[variant]:
        assert rank["plugin"] == "BF16Precision"
        assert rank["activation"] == "torch.bfloat16"
        assert rank["stored_weight"] == "torch.float32"
        # FSDP also casts the gathered parameters for compute (its mixed-precision policy); DDP leaves them in fp32.
        assert rank["weight_in_forward"] == ("torch.float32" if variant == "acc_multi_cpu" else "torch.bfloat16")


@pytest.mark.parametrize(("plugin", "expected"), [(BF16Precision(), "bf16-mixed"), (FP32Precision(), "32-true")])
def test_deepspeed_takes_the_plugins_as_its_own_precision(plugin: Any, expected: str) -> None:
    pytest.importorskip("deepspeed")
    from lightning.pytorch.plugins import DeepSpeedPrecision

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="acc_deepspeed", plugins=[plugin], **FLAGS)
    assert type(trainer.strategy.precision_plugin) is DeepSpeedPrecision
    assert trainer.strategy.precision_plugin.precision == expected
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_deepspeed", plugins=[plugin])
    assert fabric.strategy.precision.precision == expected
