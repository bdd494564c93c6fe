"""Train the same seeded model under Lightning's ``ddp`` and lightning_accel's DDP strategies (Trainer and Fabric).

Run under ``torch.distributed.run`` with 2 processes; each rank saves ``{variant}_rank{r}.pt`` holding its per-step
losses, the final weights and facts about the strategy, for ``tests/parity/test_ddp_parity.py`` to compare.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.strategies import AcceleratedDDPStrategy
from lightning_accel.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

STEPS = 6


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


def network() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def facts(strategy: Any, model: nn.Module) -> dict[str, Any]:
    return {
        "strategy_class": type(strategy).__name__,
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "comm_hooks": len(getattr(model, "_comm_hooks", [])),
        "bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
        "gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
        "distributed_type": str(getattr(strategy, "distributed_type", None)),
    }


def run_trainer(strategy: Any) -> dict[str, Any]:
    L.seed_everything(42)
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    captured: dict[str, Any] = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            captured.update(facts(trainer.strategy, trainer.strategy.model))

    trainer.callbacks.append(Capture())
    trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
    weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return {"losses": module.losses, "weights": weights, **captured}


def run_fabric(strategy: str) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    net = network()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=8, shuffle=True))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "weights": weights, **facts(fabric.strategy, model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out
    # The first variant creates the process group for the whole script: it is ours, with an explicit init method
    # (torchrun's agent hosts the store, so the TCP address must be its MASTER_ADDR:MASTER_PORT).
    init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    variants: dict[str, Any] = {
        "acc_kwargs": lambda: run_trainer(
            AcceleratedDDPStrategy(
                "MULTI_CPU",
                ddp_kwargs=DistributedDataParallelKwargs(bucket_cap_mb=1, gradient_as_bucket_view=True),
                init_kwargs=InitProcessGroupKwargs(
                    backend="gloo", init_method=init_method, timeout=timedelta(seconds=60)
                ),
            )
        ),
        "ddp": lambda: run_trainer("ddp"),
        "acc_multi_cpu": lambda: run_trainer("acc_multi_cpu"),
        "acc_ddp": lambda: run_trainer("acc_ddp"),
        "acc_fp16_hook": lambda: run_trainer(
            AcceleratedDDPStrategy("MULTI_CPU", ddp_kwargs=DistributedDataParallelKwargs(comm_hook="fp16"))
        ),
        "acc_power_sgd": lambda: run_trainer(
            AcceleratedDDPStrategy(
                "MULTI_CPU",
                ddp_kwargs=DistributedDataParallelKwargs(
                    comm_hook="power_sgd",
                    comm_wrapper="fp16",
                    comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
                ),
            )
        ),
        "fabric_ddp": lambda: run_fabric("ddp"),
        "fabric_acc_multi_cpu": lambda: run_fabric("acc_multi_cpu"),
    }
    for name, run in variants.items():
        result = run()
        torch.save(result, out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
