"""fp8 under DeepSpeed: float8 Linears inside an engine that trains in bf16.

``--accelerator cpu`` (under ``torch.distributed.run``): the engine check. fp8 is refused on CPU by the strategies, so
this drives the same pieces they use, unmocked: the bridge's translation of ``FP8Precision``, its ``convert_module``,
the DeepSpeed config reconciliation and ``deepspeed.initialize``, then a few real steps (torch 2.13's CPU
``_scaled_mm`` runs torchao's float8 matmuls), under ZeRO 2 and 3, and ZeRO 2 with ``BF16Precision`` as the
reference. Saves ``{fp8|bf16}_stage{s}_rank{r}.pt``.

``--accelerator cuda`` (one process, fp8-capable GPU): ``Trainer`` and ``Fabric`` with ``acc_deepspeed`` and
``FP8Precision()``. Saves ``trainer_rank0.pt`` and ``fabric_rank0.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.precision import FP8Precision
from lightning_accel.state import destroy_process_group

STEPS = 12
BATCH = 16


def network() -> nn.Module:
    torch.manual_seed(0)
    # Every Linear is fp8-friendly (dims divisible by 16); Accelerate's default filter keeps the first and last in bf16.
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * 4, 64, generator=g)
    return TensorDataset(x, torch.tanh(x.roll(1, dims=1)))


def describe(module: nn.Module, losses: list[float], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "float8_linears": sorted(n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "bf16": bool((config.get("bf16") or {}).get("enabled")),
        "fp16": bool((config.get("fp16") or {}).get("enabled")),
        "losses": losses,
    }


def engine_check(out: Path, variant: str, stage: int) -> None:
    """Train under ZeRO ``stage`` with ``FP8Precision`` (``variant="fp8"``) or ``BF16Precision`` (the reference)."""
    from lightning.pytorch.plugins import DeepSpeedPrecision

    from lightning_accel.precision import BF16Precision
    from lightning_accel.strategies.deepspeed_core import DeepSpeedFamily, TrainingFacts
    from lightning_accel.strategies.deepspeed_fp8 import facts_precision
    from lightning_accel.strategies.precision_adoption import _as_deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    precision = _as_deepspeed(FP8Precision() if variant == "fp8" else BF16Precision(), DeepSpeedPrecision)
    model = precision.convert_module(network())
    family = DeepSpeedFamily("acc_deepspeed", DeepSpeedPlugin(zero_stage=stage))
    family.prepare_devices([torch.device("cpu")], torch.device("cpu"))
    facts = TrainingFacts(world_size=world, device_type="cpu", precision=facts_precision(precision), micro_batch_size=8)
    family.resolve(facts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = family.engine_config(model, optimizer, None)
    engine, _, _ = family.initialize(model, optimizer, int(os.environ["LOCAL_RANK"]), config)
    x, y = dataset().tensors
    losses = []
    for step in range(STEPS):
        start = (step * world + rank) * 8 % len(x)
        rows = slice(start, start + 8)
        with precision.forward_context():
            output = engine(precision.convert_input(x[rows]))
        loss = nn.functional.mse_loss(output.float(), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = describe(engine.module, losses, config)
    result["precision_class"] = type(precision).__name__
    torch.save(result, out / f"{variant}_stage{stage}_rank{rank}.pt")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def trainer_run(out: Path) -> None:
    module = Regressor()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy="acc_deepspeed",
        plugins=[FP8Precision()],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    result = describe(trainer.strategy.model.module, module.losses, trainer.strategy.config)
    result["precision_class"] = type(trainer.strategy.precision_plugin).__name__
    torch.save(result, out / "trainer_rank0.pt")


def fabric_run(out: Path) -> None:
    fabric = L.Fabric(accelerator="cuda", devices=1, strategy="acc_deepspeed", plugins=[FP8Precision()])
    fabric.launch()
    net = network()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
    losses = []
    for _ in range(STEPS // 4):
        for x, y in fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH)):
            loss = nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    result = describe(net, losses, fabric.strategy.config)
    result["precision_class"] = type(fabric.strategy.precision).__name__
    torch.save(result, out / "fabric_rank0.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.accelerator == "cuda":
        trainer_run(args.out)
        fabric_run(args.out)
        return
    dist.init_process_group("gloo")
    try:
        for variant, stage in (("fp8", 2), ("fp8", 3), ("bf16", 2)):
            engine_check(args.out, variant, stage)
    finally:
        destroy_process_group()  # drains gloo's work and DeepSpeed's groups first (a bare destroy aborted now and then)


if __name__ == "__main__":
    main()
