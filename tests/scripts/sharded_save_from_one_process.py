"""``save_state`` under FSDP called by some processes only (2 CPU processes under ``torch.distributed.run``).

The process group's timeout is 5 s. Each rank writes what ``save_state`` raised (or ``no error``) and when, counted
from its first call, to ``OUT/rank<r>.txt``:

- ``alone``: rank 0 calls it inside ``if accelerator.is_main_process:``, as diffusers' scripts do under DDP; rank 1
  trains on (its next FSDP collective). Rank 0 exits once it has written its error, which ends rank 1 too.
- ``late``: rank 0 calls it at once, rank 1 only after rank 0 has given up: each is told of the other.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from lightning_accel import Accelerator
from lightning_accel.config import InitProcessGroupKwargs
from lightning_accel.utils import FullyShardedDataParallelPlugin

TIMEOUT = 5.0


def step(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    accelerator.backward(model(torch.ones(2, 8)).sum())
    optimizer.step()
    optimizer.zero_grad()


def attempt(accelerator: Accelerator, folder: Path, out: Path) -> None:
    start = time.monotonic()
    try:
        accelerator.save_state(str(folder))
        outcome = "no error"
    except RuntimeError as err:
        outcome = f"RuntimeError: {err}"
    out.write_text(f"{time.monotonic() - start:.1f}\n{outcome}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["alone", "late"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    handlers = [InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=TIMEOUT))]
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(), kwargs_handlers=handlers)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    step(accelerator, model, optimizer)
    out = args.out / f"rank{accelerator.process_index}.txt"
    folder = args.out / "checkpoint"
    if args.case == "alone":
        if accelerator.is_main_process:
            attempt(accelerator, folder, out)
            os._exit(3)  # as an uncaught error would end it
        step(accelerator, model, optimizer)
    else:
        if not accelerator.is_main_process:
            time.sleep(TIMEOUT + 1)
        attempt(accelerator, folder, out)
        if accelerator.is_main_process:
            time.sleep(3)  # alive when rank 1 comes


if __name__ == "__main__":
    main()
