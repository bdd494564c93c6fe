"""Sharded FSDP checkpoints for ``lightning-accel merge-weights``, written by 2 CPU processes in one launch.

1. ``Accelerator`` with FSDP2 and ``SHARDED_STATE_DICT`` trains 3 AdamW steps and calls ``save_state`` into
   ``--out/accelerator`` (which holds ``pytorch_model_fsdp_0``).
2. ``lightning.Trainer`` with ``acc_fsdp`` (FSDP1, ``SHARDED_STATE_DICT``) trains 3 steps and saves
   ``--out/trainer.ckpt`` (shards plus ``meta.pt``).

After each, plain PyTorch gathers the full state dict (``get_model_state_dict(full_state_dict=True)``), which rank 0
saves as ``--out/{accelerator,trainer}_full.pt``: what the merged files must hold.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.state import reset_state
from lightning_accel.strategies import AcceleratedFSDPStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin

STEPS = 3


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(STEPS * 2 * 4, 8, generator=generator)
    return TensorDataset(inputs, inputs[:, :4].cos())


def full_state(model: nn.Module) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True)  # on CPU already (FSDP1 crashes gathering with cpu_offload)
    state: dict[str, Any] = get_model_state_dict(model, options=options)
    return {k: v.clone() for k, v in state.items()}


def accelerator_run(out: Path) -> None:
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    )
    model = accelerator.prepare(network())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    optimizer, loader = accelerator.prepare(optimizer, DataLoader(data(), batch_size=4))
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(out / "accelerator"))
    state = full_state(model)
    if accelerator.is_main_process:
        torch.save(state, out / "accelerator_full.pt")
    accelerator.wait_for_everyone()


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_train_end(self) -> None:  # while the model is still set up for training
        model = self.trainer.strategy.model
        assert model is not None
        self.full = full_state(model)


def trainer_run(out: Path) -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=AcceleratedFSDPStrategy(plugin),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regressor()
    trainer.fit(module, DataLoader(data(), batch_size=4))
    trainer.save_checkpoint(out / "trainer.ckpt")
    if trainer.global_rank == 0:
        torch.save(module.full, out / "trainer_full.pt")
    trainer.strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    accelerator_run(out)
    reset_state()
    trainer_run(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
