"""GPU checks (marked ``gpu``; skipped without CUDA). Not run in CI: CI machines have no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, run_python, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fsdp_on_one_gpu_matches_ddp(tmp_path: pytest.TempPathFactory) -> None:
    # The CPU parity script, run on one GPU: acc_fsdp (v1, v2), accumulation and resume against Lightning's ddp.
    torchrun("fsdp_parity.py", "--out", str(tmp_path), "--accelerator", "cuda", nproc=1, timeout=600)
    for variant in ("fsdp2", "fsdp1", "fsdp2_accum", "fsdp2_resume"):
        ours = torch.load(tmp_path / f"{variant}_rank0.pt", weights_only=False)
        reference = torch.load(tmp_path / f"ddp{'_accum' if 'accum' in variant else ''}_rank0.pt", weights_only=False)
        expected = reference["losses"][-len(ours["losses"]) :]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(expected), rtol=0, atol=1e-5)


def test_fp16_scaler_skips_overflowing_steps_and_reports_it() -> None:
    import lightning as L
    from torch import nn

    from lightning_accel.precision import FP16Precision
    from lightning_accel.utils import GradScalerKwargs

    # An initial scale of 2**40 overflows fp16 gradients: the scaler must skip those steps and lower the scale.
    plugin = FP16Precision(scaler_kwargs=GradScalerKwargs(init_scale=2.0**40))
    fabric = L.Fabric(accelerator="cuda", devices=1, strategy="acc_no", plugins=[plugin])
    net = nn.Linear(64, 64)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = net.weight.detach().clone()
    with fabric.autocast():
        loss = model(torch.randn(8, 64, device=fabric.device)).float().pow(2).sum() * 1e4
    fabric.backward(loss)
    optimizer.step()
    assert plugin.step_was_skipped
    assert torch.equal(before, net.weight)
    assert plugin.scaler is not None and plugin.scaler.get_scale() < 2.0**40


def test_bf16_autocast_on_gpu() -> None:
    import lightning as L
    from torch import nn

    fabric = L.Fabric(accelerator="cuda", devices=1, strategy="acc_no", precision="bf16-mixed")
    model = fabric.setup_module(nn.Linear(16, 16))
    with fabric.autocast():
        assert model(torch.randn(4, 16, device=fabric.device)).dtype == torch.bfloat16


def test_fp8_with_torchao_converts_linears_and_trains() -> None:
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    import lightning as L
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from lightning_accel.precision import FP8Precision

    fabric = L.Fabric(accelerator="cuda", devices=1, strategy="acc_no", plugins=[FP8Precision()])
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    # Accelerate's default filter keeps the first and last Linear in high precision.
    assert [isinstance(m, Float8Linear) for m in net if isinstance(m, nn.Linear)] == [False, True, False]
    x = torch.randn(32, 64, device=fabric.device)
    losses = []
    for _ in range(20):
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_fp8_under_deepspeed_trains_with_float8_linears(tmp_path: Path) -> None:
    # Trainer and Fabric with acc_deepspeed + FP8Precision(): torchao's Float8Linear inside a bf16 DeepSpeed engine.
    pytest.importorskip("deepspeed")
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    run_python([str(SCRIPTS / "deepspeed_fp8.py"), "--out", str(tmp_path), "--accelerator", "cuda"], timeout=600)
    for name, linear in (("trainer", "net.2"), ("fabric", "2")):
        result = torch.load(tmp_path / f"{name}_rank0.pt", weights_only=False)
        assert result["precision_class"].endswith("FP8DeepSpeedPrecision")
        assert result["float8_linears"] == [linear]
        assert result["param_dtypes"] == ["torch.bfloat16"]
        assert (result["bf16"], result["fp16"]) == (True, False)
        assert result["losses"][-1] < result["losses"][0]
