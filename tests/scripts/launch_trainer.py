"""A Lightning script for ``lightning-accel launch``: trains a few steps and reports what each process saw.

``--trainer kwargs`` builds ``L.Trainer(**lightning_accel.trainer_kwargs())``; ``--trainer auto``
builds ``L.Trainer(strategy="acc_auto", accelerator="cpu", devices=LOCAL_WORLD_SIZE, num_nodes=...)``. Each process
writes ``rank<global rank>.json`` (world size, ranks, strategy, FSDP facts) into ``--out``. (Two loopback "nodes" and
``save_on_each_node`` are tested with ``launch_save_on_each_node.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel import trainer_kwargs


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def build_trainer(mode: str) -> L.Trainer:
    common: dict[str, Any] = {
        "max_steps": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if mode == "kwargs":
        return L.Trainer(**trainer_kwargs(), **common)
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = int(os.environ["WORLD_SIZE"]) // local
    return L.Trainer(strategy="acc_auto", accelerator="cpu", devices=local, num_nodes=nodes, **common)


def sharding_facts(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return {
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "full_numel": sum(p.numel() for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainer", choices=["kwargs", "auto"], default="kwargs")
    args = parser.parse_args()
    out = Path(args.out)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    module = Regressor()
    trainer = build_trainer(args.trainer)
    trainer.fit(module, DataLoader(data, batch_size=8))

    strategy = trainer.strategy
    fsdp_plugin = getattr(strategy, "fsdp_plugin", None)
    facts = {
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "num_nodes": trainer.num_nodes,
        "strategy": type(strategy).__name__,
        "distributed_type": str(getattr(getattr(strategy, "distributed_type", None), "value", None)),
        "process_group_backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "fsdp_version": getattr(fsdp_plugin, "fsdp_version", None),
        "mixed_precision_env": os.environ.get("ACCELERATE_MIXED_PRECISION"),
        "steps": trainer.global_step,
        **sharding_facts(module),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(facts))
    print(f"RESULT {json.dumps(facts)}", flush=True)


if __name__ == "__main__":
    main()
