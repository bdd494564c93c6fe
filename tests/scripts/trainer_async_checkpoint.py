"""Trainer and Fabric on ``--strategy`` (2 processes): every checkpoint saved synchronously, then in the background.

Run under ``torch.distributed.run`` with 2 processes; ``--strategy`` is ``acc_ddp`` (checkpoint files) or ``acc_fsdp``
with ``SHARDED_STATE_DICT`` (directories written by torch's DCP, ``dcp.async_save`` in the background), or
``acc_fsdp_full`` (``FULL_STATE_DICT``: gathered, then one file like ``acc_ddp``'s). The Trainer
runs carry ``CheckpointRotation(total_limit=2)`` and
``ModelCheckpoint(save_top_k=1, save_last=True)``; the background runs write through
``AsyncNamingCheckpointIO(SlowIO())``, whose only difference from the default writer is a delay before each write (so
that training, removal and rotation would overtake a write that they do not wait for), and which records what the
checkpoint folders hold when each write starts (a sharded directory does not go through it: a ``Listing`` callback
records the folders after every batch instead). Each run is then resumed from its own ``checkpoint_2`` (step 6); the
Fabric runs save twice to one path and resume from it. Both kinds run in ``--out/run``, renamed to ``sync`` or
``async`` after each, so that the checkpoints (which hold their paths) can be compared byte for byte. Rank ``r`` saves
``results_rank{r}.pt`` for ``tests/launch/test_async_checkpoint_io.py``, which also compares the files on disk. With
``acc_fsdp``, a last run meets the file size limit (``RLIMIT_FSIZE``) in a background sharded write.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel
from lightning_accel.callbacks import CheckpointRotation
from lightning_accel.config import FullyShardedDataParallelPlugin, ProjectConfiguration
from lightning_accel.strategies import AsyncNamingCheckpointIO
from lightning_accel.strategies.checkpoint_io import NamingTorchCheckpointIO

DELAY = 0.2  # seconds before each background write
MAX_STEPS, SAVE_EVERY, TOTAL_LIMIT, RESUME_FROM = 8, 2, 2, 2
FABRIC_STEPS, FABRIC_SAVES = 6, (2, 4)


class SlowIO(NamingTorchCheckpointIO):
    """The default writer after a delay; records each write's file and the listing of ``watched`` folders then."""

    def __init__(self, watched: list[Path]) -> None:
        super().__init__()
        self.watched = watched
        self.writes: list[tuple[str, dict[str, list[str]], int | None]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        time.sleep(DELAY)
        listing = {d.name: sorted(os.listdir(d)) for d in self.watched if d.exists()}
        self.writes.append((Path(path).name, listing, _step_in(Path(path))))
        super().save_checkpoint(checkpoint, path, storage_options)


def _step_in(writing: Path) -> int | None:
    """The ``step`` of the complete file the write at ``writing`` (``.<name>.writing``) replaces, if one is there."""
    final = writing.with_name(writing.name.removeprefix(".").removesuffix(".writing"))
    return torch.load(final, weights_only=True)["step"] if final.name.startswith("fabric") and final.exists() else None


def strategy_and_plugins(name: str, io: AsyncNamingCheckpointIO | None, *, fabric: bool) -> dict[str, Any]:
    """``acc_ddp`` by name (the I/O a plugin), or an ``acc_fsdp`` object (the I/O its own): sharded, or ``_full``."""
    if name == "acc_ddp":
        return {"strategy": name, "plugins": [io] if io is not None else []}
    full = name == "acc_fsdp_full"
    plugin = FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT" if full else "SHARDED_STATE_DICT")
    options: dict[str, Any] = {"fsdp_plugin": plugin} if io is None else {"fsdp_plugin": plugin, "checkpoint_io": io}
    return {"strategy": lightning_accel.strategy_for("FSDP", fabric=fabric, **options)}


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every process's copy of the whole weights (gathered from FSDP's shards; collective there)."""
    state = module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


class Listing(Callback):
    """Records, on global rank 0 after each batch, the checkpoint folders' entries (what a resume would find)."""

    def __init__(self, watched: list[Path]) -> None:
        self.watched = watched
        self.listings: list[dict[str, list[str]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.listings.append({d.name: sorted(os.listdir(d)) for d in self.watched if d.exists()})


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, x[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g))


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def trainer_run(name: str, root: Path, *, background: bool, resume: bool) -> dict[str, Any]:
    """Fit (or resume from ``checkpoint_2``): the final weights and, on rank 0, what the writer and listing saw."""
    L.seed_everything(0)
    rotation = CheckpointRotation(
        ProjectConfiguration(root, automatic_checkpoint_naming=True, total_limit=TOTAL_LIMIT),
        every_n_train_steps=100 if resume else SAVE_EVERY,
    )
    listing = Listing([root / "checkpoints", root / "mc"])
    callbacks: list[Any] = [listing, rotation]
    if not resume:
        best = ModelCheckpoint(
            dirpath=root / "mc", filename="{step}", monitor="loss", save_top_k=1, save_last=True, every_n_train_steps=1
        )
        callbacks.append(best)
    slow = SlowIO([root / "checkpoints", root / "mc"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **strategy_and_plugins(name, AsyncNamingCheckpointIO(slow) if background else None, fabric=False),
    )
    model = Regressor()
    ckpt_path = str(root / "checkpoints" / f"checkpoint_{RESUME_FROM}") if resume else None
    trainer.fit(model, DataLoader(dataset(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return {"weights": full_weights(model), "writes": slow.writes, "listings": listing.listings}


def fabric_run(name: str, path: Path, *, background: bool, resume: bool) -> dict[str, Any]:
    """Train a few steps, saving twice to ``path`` (or resume from it); the final weights, what the writer saw."""
    slow = SlowIO([path.parent])
    io = AsyncNamingCheckpointIO(slow) if background else None
    fabric = L.Fabric(accelerator="cpu", devices=2, **strategy_and_plugins(name, io, fabric=True))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(path, state)
    x, y = dataset().tensors
    for step in range(state["step"], FABRIC_STEPS):
        rows = slice(8 * step + 4 * fabric.global_rank, 8 * step + 4 * fabric.global_rank + 4)
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if not resume and state["step"] in FABRIC_SAVES:
            fabric.save(path, state)
    fabric.strategy.checkpoint_io.teardown()  # a background save is finished (its error raised) here
    fabric.barrier()
    return {"weights": full_weights(model), "writes": slow.writes}


def sharded_write_error(name: str, folder: Path) -> dict[str, Any]:
    """Save ``good``, then ``bad`` past the file size limit: the next save raises on every process; ``good`` loads."""
    io = AsyncNamingCheckpointIO()
    fabric = L.Fabric(accelerator="cpu", devices=2, **strategy_and_plugins(name, io, fabric=True))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 1}
    fabric.save(folder / "good", state)
    io.wait()  # every process: "good" is published before the limit
    saved = full_weights(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # bytes: no shard file fits
    try:
        fabric.save(folder / "bad", {**state, "step": 2})  # returns: the shards are written in the background
        try:
            fabric.save(folder / "next", {**state, "step": 3})
            raised: BaseException | None = None
        except BaseException as error:
            raised = error
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    fabric.barrier()
    entries = sorted(p.name for p in folder.iterdir())
    fabric.load(folder / "good", state)
    io.teardown()
    return {
        "error": type(raised).__name__,
        "errno": getattr(raised, "errno", None),
        "message": str(raised),
        "entries": entries,
        "restored": all(torch.equal(v, saved[k]) for k, v in full_weights(model).items()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["acc_ddp", "acc_fsdp", "acc_fsdp_full"], required=True)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    run = args.out / "run"  # both kinds save under the same path (checkpoints hold it), then it is renamed
    for kind in ("sync", "async"):
        background = kind == "async"
        results[f"trainer_{kind}"] = trainer_run(args.strategy, run, background=background, resume=False)
        results[f"trainer_{kind}_resumed"] = trainer_run(args.strategy, run, background=background, resume=True)
        path = run / "fabric" / "fabric.ckpt"
        results[f"fabric_{kind}"] = fabric_run(args.strategy, path, background=background, resume=False)
        results[f"fabric_{kind}_resumed"] = fabric_run(args.strategy, path, background=background, resume=True)
        if dist.get_rank() == 0:
            run.rename(args.out / kind)
        dist.barrier()
    if args.strategy == "acc_fsdp":
        results["sharded_write_error"] = sharded_write_error(args.strategy, args.out / "errors")
    torch.save(results, args.out / f"results_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
