"""Train with CheckpointRotation and stall inside a save, so a test can SIGKILL the process mid-write; or resume.

``--mode train``: the save of ``checkpoint_{--stall-at}`` writes half of its bytes, creates ``--ready`` and sleeps
(the test kills the process there). ``--mode resume``: resume with ``ckpt_path="last"`` and print a JSON summary.
``--background``: the same writer runs inside ``AsyncNamingCheckpointIO``, so the stall is in its thread (training goes
on to the next save, which waits for it) and the half-written file is the hidden ``.checkpoint_2.incomplete.writing``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.callbacks import CheckpointRotation, complete_checkpoints
from lightning_accel.config import ProjectConfiguration
from lightning_accel.strategies import AsyncNamingCheckpointIO


class StallingCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints normally, except number ``stall_at``: half of it, then a signal, then sleep."""

    def __init__(self, stall_at: int, ready: Path) -> None:
        super().__init__()
        self.stall_at = stall_at
        self.ready = ready
        self.saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if self.saves == self.stall_at:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            data = buffer.getvalue()
            with open(path, "wb") as file:
                file.write(data[: len(data) // 2])
                file.flush()
                os.fsync(file.fileno())
            self.ready.write_text(str(path))
            time.sleep(600)
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.resumed_at_step = -1

    def on_train_start(self) -> None:
        self.resumed_at_step = self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "resume"], required=True)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--stall-at", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--background", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    plugins: list[Any] = [StallingCheckpointIO(args.stall_at, args.ready)] if args.mode == "train" else []
    if args.background:
        plugins = [AsyncNamingCheckpointIO(*plugins)]
    rotation = CheckpointRotation(
        ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=2), every_n_train_steps=1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation],
        plugins=plugins,
    )
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path="last" if args.mode == "resume" else None)
    summary = {
        "resumed_at_step": model.resumed_at_step,
        "global_step": trainer.global_step,
        "checkpoints": [p.name for p in complete_checkpoints(args.project / "checkpoints")],
        "entries": sorted(p.name for p in (args.project / "checkpoints").iterdir()),
    }
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main()
