"""A Trainer run (2 CPU processes, CheckpointRotation + SeedableSampler) that a restart must finish bit for bit.

The processes run under one launcher or under two (one "node" each), started with ``lightning-accel launch
--max_restarts 1``. With ``--kill-at-step N``, rank 1 of the first attempt SIGKILLs itself once step ``N`` is
checkpointed; the launcher restarts the workers, which resume from the newest complete checkpoint
(``fit(ckpt_path="last")``). Rank 0 writes the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.callbacks import CheckpointRotation, SeedableSampler
from lightning_accel.config import ProjectConfiguration


class Model(L.LightningModule):
    def __init__(self, kill_at_step: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
        self.kill_at_step = kill_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.global_rank == 1 and self.trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # after checkpoint_{kill_at_step / 2 - 1} is complete

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill-at-step", type=int)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    rotation = CheckpointRotation(
        ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=2), every_n_train_steps=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        strategy="acc_multi_cpu",
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation, SeedableSampler(data_seed=7)],
    )
    model = Model(args.kill_at_step)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path="last")
    if trainer.is_global_zero:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
