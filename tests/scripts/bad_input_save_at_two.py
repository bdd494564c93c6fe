"""Save a checkpoint mid-epoch at 2 processes (``torchrun --nproc_per_node 2``): ``bad_input_save_at_two.py OUT``.

Trains 3 steps of epoch 1 (8 batches per process per epoch) and saves ``OUT/ckpt``; writes the weights then to
``OUT/weights.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.utils import set_seed


def main() -> None:
    out = Path(sys.argv[1])
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.arange(64.0).reshape(32, 2)), batch_size=2, shuffle=True)
    model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), data)
    for epoch in range(2):
        for step, (x,) in enumerate(data):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if epoch == 1 and step == 2:
                accelerator.save_state(out / "ckpt")
                if accelerator.is_main_process:
                    torch.save(accelerator.unwrap_model(model).state_dict(), out / "weights.pt")
                accelerator.wait_for_everyone()
                accelerator.end_training()
                return


if __name__ == "__main__":
    main()
