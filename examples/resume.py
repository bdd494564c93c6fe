"""Compose the three lightning_accel callbacks, get interrupted, resume, and end where an uninterrupted run ends.

Three phases on the same model (with dropout), data and step-interval learning-rate schedule:

1. train with ``GradientAccumulation`` + ``SeedableSampler`` + ``CheckpointRotation`` until a simulated
   preemption stops the job between two checkpoints;
2. resume in a new Trainer with ``trainer.fit(..., ckpt_path="last")`` from the newest complete checkpoint;
3. (``--verify``, on by default) train the same run uninterrupted in another directory and compare the weights.

By default it starts 2 CPU processes with ``strategy="acc_multi_cpu"``::

    python examples/resume.py
    python examples/resume.py --strategy acc_no --devices 1
    python examples/resume.py --project_dir runs/exp1 --interrupt_at 9 --no-verify
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* strategy names)
from lightning_accel.callbacks import CheckpointRotation, GradientAccumulation, SeedableSampler, latest_checkpoint
from lightning_accel.config import ProjectConfiguration


class SimulatedPreemption(RuntimeError):
    """What a pre-empted job sees: training stops wherever it is, between two checkpoints."""


class PreemptAt(L.Callback):
    """Raise :class:`SimulatedPreemption` on every process once ``step`` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise SimulatedPreemption(f"preempted after optimizer step {self.step}")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_loader(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, generator=g)
    y = x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(500, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def make_trainer(args: argparse.Namespace, project: Path, *extra: L.Callback) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            GradientAccumulation(num_steps=args.accumulate),
            SeedableSampler(data_seed=args.seed),
            CheckpointRotation(
                ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=args.keep),
                every_n_train_steps=args.save_every,
            ),
            *extra,
        ],
    )


def fit(args: argparse.Namespace, trainer: L.Trainer, ckpt_path: str | None = None) -> Regressor:
    L.seed_everything(args.seed, verbose=False)
    model = Regressor()
    trainer.fit(model, train_loader(args.batch_size), ckpt_path=ckpt_path)
    return model


def shared_project_dir(requested: str | None) -> Path:
    """One directory for every process: Lightning's launcher re-runs this script, and children inherit the env."""
    if "RESUME_EXAMPLE_DIR" not in os.environ:
        os.environ["RESUME_EXAMPLE_DIR"] = requested or tempfile.mkdtemp(prefix="lightning_accel_resume_")
    return Path(os.environ["RESUME_EXAMPLE_DIR"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="acc_multi_cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--project_dir", default=None, help="a new directory (default: a fresh temporary one)")
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=3)
    parser.add_argument("--save_every", type=int, default=4, help="optimizer steps between checkpoints")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep (total_limit)")
    parser.add_argument("--interrupt_at", type=int, default=11, help="optimizer step of the simulated preemption")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    root = shared_project_dir(args.project_dir)

    interrupted = make_trainer(args, root / "run", PreemptAt(args.interrupt_at))
    try:
        fit(args, interrupted)
    except SimulatedPreemption as preemption:
        if interrupted.is_global_zero:
            print(f"{preemption}; newest complete checkpoint: {latest_checkpoint(root / 'run')}")
    trainer = make_trainer(args, root / "run")
    resumed = fit(args, trainer, ckpt_path="last")
    if trainer.is_global_zero:
        kept = sorted(p.name for p in (root / "run" / "checkpoints").iterdir())
        print(f"resumed from {trainer.ckpt_path}, finished {args.max_epochs} epochs; checkpoints kept: {kept}")
    if not args.verify:
        return
    reference = make_trainer(args, root / "uninterrupted")
    uninterrupted = fit(args, reference)
    weights = uninterrupted.state_dict()
    same = all(torch.equal(value, weights[name]) for name, value in resumed.state_dict().items())
    if reference.is_global_zero:
        print(f"resumed run matches the uninterrupted run bit for bit: {same}")


if __name__ == "__main__":
    main()
