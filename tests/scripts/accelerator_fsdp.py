"""The shim on 2 CPU processes: the same accumulation loop under DDP (MULTI_CPU) and FSDP2, one launch.

Each rank writes ``fsdp_rank{r}.pt`` with both runs' full weights, for ``tests/launch/test_accelerator_fsdp.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.state import reset_state
from lightning_accel.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin


def train(**plugins: Any) -> dict[str, Any]:
    reset_state()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3),
        **plugins,
    )
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    return {"type": str(accelerator.distributed_type), "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out: Path = parser.parse_args().out
    ddp = train()
    fsdp = train(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    rank = torch.distributed.get_rank()
    torch.save({"ddp": ddp, "fsdp": fsdp}, out / f"fsdp_rank{rank}.pt")
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
