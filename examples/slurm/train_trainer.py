"""Train a small regressor with ``Trainer(strategy="acc_ddp")``, one process per SLURM task.

Started by ``srun`` (see ``trainer.sbatch``): Lightning's ``SLURMEnvironment`` reads each process's rank from
``SLURM_PROCID`` / ``SLURM_LOCALID`` and the world from ``SLURM_NTASKS``; ``--devices`` and ``--num_nodes`` must
match ``--ntasks-per-node`` and ``--nodes``. The same script runs under ``torchrun --nproc_per_node 2`` too.

Preemption: with ``#SBATCH --signal=SIGUSR1@90``, SLURM sends SIGUSR1 90 s before the time limit; Lightning saves
``<root>/hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue $SLURM_JOB_ID``. The requeued job runs this script again, and
``fit`` resumes from the newest ``hpc_ckpt_*.ckpt`` in ``--root`` (Lightning does so by itself under SLURM).

Tested by ``tests/launch/test_slurm.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* strategy names)


class Regressor(L.LightningModule):
    """A two-layer MLP fitting the sum of its inputs."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def train_data(samples: int = 64) -> DataLoader:
    """Synthetic inputs and their sums; Lightning shards them across processes (a ``DistributedSampler``)."""
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="default_root_dir: where hpc_ckpt_*.ckpt go")
    parser.add_argument("--devices", type=int, default=2, help="processes per node (= --ntasks-per-node)")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes (= --nodes)")
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="where process 0 writes the final weights")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    args = parse_args(argv)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",  # "gpu" on a GPU partition (with --gpus-per-node equal to --ntasks-per-node)
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="acc_ddp",
        max_epochs=args.max_epochs,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    model = Regressor()
    trainer.fit(model, train_data())  # resumes from <root>/hpc_ckpt_<n>.ckpt after a requeue
    environment = type(trainer.strategy.cluster_environment).__name__
    if trainer.is_global_zero:
        print(f"trained {trainer.current_epoch} epochs on {trainer.world_size} processes ({environment})")
    if args.out is not None and trainer.is_global_zero:
        torch.save({name: value.clone() for name, value in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
