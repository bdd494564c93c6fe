"""The three callbacks on one Trainer, stopped and resumed, against the uninterrupted run.

Run under ``torch.distributed.run`` with 2 processes: ``--strategy`` names the strategy (``acc_multi_cpu``, ...).
Every scenario trains the same seeded model (with dropout, a step-interval LR scheduler, gradient accumulation and
a seedable shuffled dataloader); each rank saves ``{scenario}_rank{r}.pt`` with what it saw and its final weights,
for ``tests/launch/test_callbacks_distributed.py`` to compare.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.callbacks import CheckpointRotation, GradientAccumulation, SeedableSampler, complete_checkpoints
from lightning_accel.config import ProjectConfiguration

# 38 samples, 2 processes, batches of 4: 5 batches per process and epoch (Accelerate pads the last round with 2
# samples from the start). With num_steps=2 the optimizer steps after batches 1, 3 and 4: the last window holds one.
NUM_SAMPLES = 38
BATCH_SIZE = 4
NUM_STEPS = 2
MAX_EPOCHS = 3
DATA_SEED = 1234
TOTAL_LIMIT = 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = x[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(NUM_SAMPLES, 1, generator=g)
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        self.seen: list[tuple[int, int, list[int], float]] = []
        self.steps: list[tuple[int, int, float]] = []
        self.micro_batch_grads: list[torch.Tensor | None] = []
        self.boundaries: list[bool] = []  # DeepSpeed's accumulation boundary at each backward
        self.record_grads = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.seen.append((self.current_epoch, batch_idx, index.tolist(), loss.item()))
        return loss

    def on_after_backward(self) -> None:
        if self.record_grads:
            self.micro_batch_grads.append(micro_batch_grad(self.net[0].weight))
            engine = self.trainer.strategy.model
            if hasattr(engine, "is_gradient_accumulation_boundary"):
                self.boundaries.append(engine.is_gradient_accumulation_boundary())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.append((self.current_epoch, self.trainer.fit_loop.batch_idx, optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """An unsharded copy (sharded strategies hold DTensors)."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().cpu().clone()


def micro_batch_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full gradient of ``param`` after a backward; ``None`` where the strategy keeps it out of reach.

    FSDP may keep unsynchronised gradients in its own buffers (then ``.grad`` is None); DeepSpeed's ZeRO keeps them in
    its optimizer, where ``deepspeed.utils.safe_get_full_grad`` reads them after a backward that reached the
    accumulation boundary (and refuses to inside a window).
    """
    grad = param.grad
    if grad is None and hasattr(param, "_hp_mapping"):
        from deepspeed.utils import safe_get_full_grad

        try:
            grad = safe_get_full_grad(param)
        except ValueError:  # "Gradients are only available immediately after backward and before engine step"
            return None
    return None if grad is None else full_tensor(grad)


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_tensor(value) for name, value in module.state_dict().items()}


def fit(
    strategy: str, project: Path, ckpt_path: str | None = None, sync_with_dataloader: bool = True, **limits: Any
) -> dict[str, Any]:
    L.seed_everything(7)
    module = Regressor()
    rotation = CheckpointRotation(
        ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=TOTAL_LIMIT),
        every_n_train_steps=1,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            GradientAccumulation(NUM_STEPS, sync_with_dataloader=sync_with_dataloader),
            SeedableSampler(DATA_SEED),
            rotation,
        ],
        **limits,
    )
    loader = DataLoader(dataset(), batch_size=BATCH_SIZE, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return {
        "seen": module.seen,
        "steps": module.steps,
        "weights": full_weights(module),
        "global_step": trainer.global_step,
        "checkpoints": [p.name for p in complete_checkpoints(project / "checkpoints")],
        "iteration": rotation.project_config.iteration,
    }


def stop_and_resume(strategy: str, project: Path, sync_with_dataloader: bool = True, **stop: Any) -> dict[str, Any]:
    first = fit(strategy, project, sync_with_dataloader=sync_with_dataloader, **stop)
    second = fit(strategy, project, "last", sync_with_dataloader=sync_with_dataloader, max_epochs=MAX_EPOCHS)
    return {**second, "first": first}


def sync_each_batch(strategy: str, enabled: bool | None) -> dict[str, Any]:
    """One optimizer step over 2 micro-batches: the first micro-batch's gradient on every rank and the weights after.

    ``enabled=None`` is the reference: Lightning's own ``ddp`` with ``accumulate_grad_batches=2`` (no callback), whose
    first micro-batch keeps each rank's local gradient. Dropout is off, so the gradients depend on the data only.
    """
    L.seed_everything(7)
    module = Regressor()
    module.net[2].p = 0.0
    module.record_grads = True
    callbacks: list[L.Callback] = [SeedableSampler(DATA_SEED)]
    if enabled is not None:
        callbacks.append(GradientAccumulation(NUM_STEPS, sync_each_batch=enabled))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp" if enabled is None else strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=1,
        accumulate_grad_batches=NUM_STEPS if enabled is None else 1,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH_SIZE, shuffle=True))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, module.micro_batch_grads[0])
    return {
        "first_micro_batch_grads": gathered,
        "micro_batches": len(module.micro_batch_grads),
        "boundaries": module.boundaries,
        "global_step": trainer.global_step,
        "weights": full_weights(module),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    strategy, out = args.strategy, args.out
    # 3 optimizer steps per epoch: step 4 is the second batch of epoch 1 (mid-epoch); without sync_with_dataloader
    # windows carry over and step 3 is the first batch of epoch 1, whose window started in epoch 0.
    scenarios: dict[str, Any] = {
        "full": lambda: fit(strategy, out / "full", max_epochs=MAX_EPOCHS),
        "epoch_boundary": lambda: stop_and_resume(strategy, out / "epoch_boundary", max_epochs=1),
        "mid_epoch": lambda: stop_and_resume(strategy, out / "mid_epoch", max_steps=4),
        "carry_full": lambda: fit(strategy, out / "carry_full", sync_with_dataloader=False, max_epochs=MAX_EPOCHS),
        "carry_mid_epoch": lambda: stop_and_resume(
            strategy, out / "carry_mid_epoch", sync_with_dataloader=False, max_steps=3
        ),
        "sync_reference": lambda: sync_each_batch(strategy, None),
        "sync_each_batch": lambda: sync_each_batch(strategy, True),
        "no_sync": lambda: sync_each_batch(strategy, False),
    }
    for name, run in scenarios.items():
        result = run()
        torch.save(result, out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
