"""An Accelerate-style loop (2 CPU processes) that a restart must finish bit for bit, through the ``Accelerator``.

Started by ``lightning-accel launch --max_restarts 1``. ``accelerator.load_state(missing_ok=True,
resume_position=True)`` before the loop starts the first attempt fresh and resumes a restarted one from the newest
complete checkpoint (weights, optimizer, RNG states, the loader's position and the registered step counter). With
``--kill-at-step N``, rank 1 of the first attempt SIGKILLs itself after step ``N``. Rank 0 writes the final weights
to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

STEPS = 12


class Progress:
    """The number of optimizer steps done, saved with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill-at-step", type=int)
    args = parser.parse_args()
    set_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4, shuffle=True))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state(missing_ok=True, resume_position=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while progress.step < STEPS:
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % 2 == 0:
                accelerator.save_state()
            if first_attempt and accelerator.process_index == 1 and progress.step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.step == STEPS:
                break
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.clone() for k, v in weights.items()}, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
