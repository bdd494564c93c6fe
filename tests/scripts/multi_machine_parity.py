"""One small training script for HF accelerate's ``Accelerator`` and lightning_accel's, launched on two "machines".

``--library hf|ours`` picks the ``Accelerator``; ``--cpu`` passes ``cpu=True`` (what HF's needs to join a CPU group
under ``accelerate launch --multi_gpu``). Each process trains 4 DDP steps and writes ``rank<i>.pt``: its final
weights and facts (processes, distributed type, collective backend, world size).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=("hf", "ours"), required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerate = importlib.import_module("accelerate" if args.library == "hf" else "lightning_accel")
    accelerator = accelerate.Accelerator(cpu=True) if args.cpu else accelerate.Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for inputs, targets in data:
        accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    facts = {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type.value),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": weights, "facts": facts}, out / f"rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()
