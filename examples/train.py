"""Train a classifier on synthetic data with a lightning_accel strategy.

By default it starts 2 CPU processes with ``strategy="acc_ddp"`` (DistributedDataParallel over gloo) and reports the
validation accuracy computed by torchmetrics::

    python examples/train.py                                   # acc_ddp, 2 CPU processes
    python examples/train.py --strategy acc_no --devices 1     # one process
    python examples/train.py --accelerator gpu --strategy acc_multi_gpu --devices 4
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* strategy names)

NUM_CLASSES = 4
NUM_FEATURES = 32


def synthetic_split(samples: int, seed: int) -> TensorDataset:
    """Gaussian blobs around fixed class centres: learnable, but not in one step."""
    centres = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=torch.Generator().manual_seed(0)) * 1.0
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (samples,), generator=g)
    features = centres[labels] + torch.randn(samples, NUM_FEATURES, generator=g) * 2.5
    return TensorDataset(features, labels)


class Classifier(L.LightningModule):
    """A two-layer MLP with accuracy tracked by torchmetrics."""

    def __init__(self, hidden: int = 128, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES))
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=NUM_CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_accuracy(self.net(x), y)
        self.log("val_acc", self.val_accuracy, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="acc_ddp", help="a registered strategy name, e.g. acc_ddp, acc_no")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    L.seed_everything(args.seed)
    train = DataLoader(synthetic_split(4096, seed=1), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(synthetic_split(1024, seed=2), batch_size=256)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
    )
    model = Classifier()
    trainer.fit(model, train, val)
    accuracy = trainer.callback_metrics["val_acc"].item()
    if trainer.is_global_zero:
        print(f"strategy={args.strategy} world_size={trainer.world_size} final val_acc={accuracy:.4f}")


if __name__ == "__main__":
    main()
