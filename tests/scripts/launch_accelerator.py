"""An Accelerate-style script for ``lightning-accel launch``: ``Accelerator()`` takes its setup from the launcher.

Only the import differs from an HF accelerate script. Each process trains a few steps and writes
``rank<process index>.json`` (processes, ranks, distributed type, precision, device, FSDP facts) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(64, 32), torch.randn(64, 1)), batch_size=8)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    steps = 0
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    facts = {
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "local_process_index": accelerator.local_process_index,
        "distributed_type": str(accelerator.distributed_type.value),
        "mixed_precision": accelerator.mixed_precision,
        "device": accelerator.device.type,
        "steps": steps,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(facts))
    print(f"RESULT {json.dumps(facts)}", flush=True)


if __name__ == "__main__":
    main()
