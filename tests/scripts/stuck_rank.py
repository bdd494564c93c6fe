"""One rank stops answering at step 2 (it sleeps, outside any collective); the other waits in the next collective.

``--mode trainer``: ``Trainer(strategy="acc_ddp", devices=2)`` started with ``python`` (Lightning starts rank 1 as a
child of rank 0). ``--mode accelerator``: the ``Accelerator`` loop under ``torchrun``. ``--stuck`` is the rank that
sleeps. The process-group timeout is ``--timeout`` seconds. Each process writes ``pid_<rank>`` into ``--out`` at the
start, and the stuck one writes ``stuck_<rank>`` (the time) when it starts sleeping.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


def _mark(out: Path, name: str, rank: int, text: str) -> None:
    (out / f"{name}_{rank}").write_text(text)


def _maybe_stick(out: Path, rank: int, stuck: int, step: int) -> None:
    if rank == stuck and step == 2:
        _mark(out, "stuck", rank, repr(time.time()))
        time.sleep(600)


def trainer(args: argparse.Namespace) -> None:
    import lightning as L

    from lightning_accel import InitProcessGroupKwargs
    from lightning_accel.strategies import AcceleratedDDPStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            _maybe_stick(args.out, self.global_rank, args.stuck, batch_idx)
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    _mark(args.out, "pid", int(os.environ.get("LOCAL_RANK", "0")), str(os.getpid()))
    strategy = AcceleratedDDPStrategy(init_kwargs=InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout)))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer.fit(Model(), data)


def accelerator(args: argparse.Namespace) -> None:
    from lightning_accel import Accelerator, InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))])
    _mark(args.out, "pid", acc.process_index, str(os.getpid()))
    model = torch.nn.Linear(4, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(6):
        _maybe_stick(args.out, acc.process_index, args.stuck, step)
        acc.backward(model(torch.randn(4, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["trainer", "accelerator"], required=True)
    parser.add_argument("--stuck", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    {"trainer": trainer, "accelerator": accelerator}[arguments.mode](arguments)
