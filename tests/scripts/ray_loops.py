"""Ray Train training functions for tests/launch/test_ray.py (2 CPU workers over gloo).

Each runs inside a Ray Train worker (``TorchTrainer(train_loop_per_worker=...)``) and writes the final weights of
rank 0 to ``config["out"] / f"{name}.pt"``. With ``config["kill_at_step"]``, the worker of rank 1 ends its
process (``os._exit``) after that optimizer step on the first attempt only (a marker file says it happened); Ray
restarts the worker group (``FailureConfig(max_failures=1)``) and the function resumes from
``ray.train.get_checkpoint()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import ray.train
import torch
from ray.train import Checkpoint
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  # registers the acc_* strategy names
from lightning_accel import Accelerator
from lightning_accel.integrations.ray import prepare_trainer

EPOCHS = 3
BATCH = 4  # per worker: 32 samples over 2 workers are 4 steps an epoch


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _rank() -> int:
    return ray.train.get_context().get_world_rank()


def _kill_here(config: Mapping[str, Any], step: int) -> bool:
    """True once: on rank 1 of the first attempt, at ``config["kill_at_step"]`` (the marker file records it)."""
    if config.get("kill_at_step") != step or _rank() != 1:
        return False
    try:
        (Path(config["out"]) / "killed").open("x").close()
    except FileExistsError:
        return False
    return True


def _save(config: Mapping[str, Any], name: str, weights: Mapping[str, torch.Tensor]) -> None:
    if _rank() == 0:
        torch.save({key: value.detach().cpu().clone() for key, value in weights.items()}, Path(config["out"]) / name)


class _KillAtStep(L.Callback):
    """Ends rank 1's process at ``config["kill_at_step"]`` (first attempt); notes the model's wrapper as it trains."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.wrapper = ""

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.wrapper = type(trainer.strategy.model).__name__

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if _kill_here(self.config, trainer.global_step):
            os._exit(1)


def _strategy(name: str) -> L.pytorch.strategies.Strategy | str:
    return RayDDPStrategy() if name == "ray_ddp" else name


def fit_trainer(config: Mapping[str, Any], strategy: str, checkpoint: Checkpoint | None) -> None:
    """Ray's Lightning recipe (``devices="auto"``, Ray's environment and report callback) with ``strategy``.

    A restarted worker resumes from ``checkpoint`` (Ray's ``get_checkpoint()``) with ``ckpt_path``.
    """
    watch = _KillAtStep(config)
    trainer = L.Trainer(
        accelerator="cpu",
        devices="auto",
        strategy=_strategy(strategy),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), watch],
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    module = Regression()
    loader = DataLoader(dataset(), batch_size=BATCH)
    if checkpoint is None:
        trainer.fit(module, loader)
    else:
        with checkpoint.as_directory() as folder:
            trainer.fit(module, loader, ckpt_path=Path(folder) / RayTrainReportCallback.CHECKPOINT_NAME)
    weights = {
        key.removeprefix("net."): _full(value) for key, value in trainer.strategy.lightning_module_state_dict().items()
    }
    _save(config, f"trainer_{strategy}.pt", weights)
    if _rank() == 0:  # what ran: the strategy class and the wrapper of the model (DDP, FSDP, DeepSpeed's engine)
        ran = {"strategy": type(trainer.strategy).__name__, "model": watch.wrapper}
        (Path(config["out"]) / f"trainer_{strategy}.json").write_text(json.dumps(ran))


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank calls it)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def trainer_loop(config: Mapping[str, Any]) -> None:
    """One Trainer run per name in ``config["strategies"]``, one after the other in the same workers.

    Only the first resumes from the checkpoint the workers started with; the others start fresh (the runs before
    them reported checkpoints too).
    """
    checkpoint = ray.train.get_checkpoint()
    for strategy in config["strategies"]:
        fit_trainer(config, strategy, checkpoint)
        checkpoint = None


def accelerator_loop(config: Mapping[str, Any]) -> None:
    """An Accelerate loop: ``save_state`` into a Ray checkpoint every epoch, ``load_state`` from it on a restart."""
    accelerator = Accelerator(cpu=True)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(dataset(), batch_size=BATCH))
    first_epoch = _resume(accelerator)
    for epoch in range(first_epoch, EPOCHS):
        for step, (x, y) in enumerate(loader, start=epoch * len(loader) + 1):
            loss = nn.functional.mse_loss(net(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if _kill_here(config, step):
                os._exit(1)
        _report(accelerator, Path(config["out"]) / f"epoch_{epoch}", epoch)
    _save(config, "accelerator.pt", accelerator.unwrap_model(net).state_dict())


def _resume(accelerator: Accelerator) -> int:
    """The epoch to start from: 0, or the one after the reported checkpoint's (whose state is loaded)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        accelerator.load_state(Path(folder) / "state")
        return int(json.loads((Path(folder) / "progress.json").read_text())["epoch"]) + 1


def _report(accelerator: Accelerator, folder: Path, epoch: int) -> None:
    """Save the state into ``folder`` (shared by the workers of this machine); rank 0 reports it to Ray."""
    accelerator.save_state(folder / "state")
    if accelerator.is_main_process:
        (folder / "progress.json").write_text(json.dumps({"epoch": epoch}))
    accelerator.wait_for_everyone()
    checkpoint = Checkpoint.from_directory(folder) if accelerator.is_main_process else None
    ray.train.report({"epoch": epoch}, checkpoint=checkpoint)
