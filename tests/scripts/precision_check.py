"""bf16 autocast under acc_multi_cpu and acc_fsdp (v1, v2) on 2 CPU processes: what dtypes training really used."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.strategies import AcceleratedFSDPStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin
from tests.scripts.ddp_parity import Regressor, dataset


class DtypeProbe(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, str] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden = self.net[0](batch[0])
        self.seen = {"activation": str(hidden.dtype), "weight_in_forward": str(self.net[0].weight.dtype)}
        return super().training_step(batch, batch_idx)


def run(strategy: Any) -> dict[str, Any]:
    L.seed_everything(42)
    module = DtypeProbe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=8))
    return {
        **module.seen,
        "plugin": type(trainer.strategy.precision_plugin).__name__,
        "losses": module.losses,
        "stored_weight": str(next(iter(trainer.strategy.model.parameters())).dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    variants = {
        "acc_multi_cpu": lambda: run("acc_multi_cpu"),
        "fsdp2": lambda: run("acc_fsdp"),
        "fsdp1": lambda: run(AcceleratedFSDPStrategy(FullyShardedDataParallelPlugin(fsdp_version=1))),
    }
    for name, variant in variants.items():
        torch.save(variant(), out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
