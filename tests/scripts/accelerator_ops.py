"""The Accelerator's collectives and sync control on 2 CPU processes (run under ``torch.distributed.run``).

Each rank writes ``ops_rank{r}.pt`` with what it observed, for ``tests/launch/test_accelerator_distributed.py``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.utils import operations, set_seed, synchronize_rng_state


def collectives(accelerator: Accelerator) -> dict[str, Any]:
    rank = accelerator.process_index
    mine = torch.full((2,), float(rank))
    uneven = torch.arange(rank + 1, dtype=torch.float32) + 1
    return {
        "gather": accelerator.gather(mine).tolist(),
        "gather_scalar": accelerator.gather(torch.tensor(rank)).tolist(),
        "gather_nested": operations.listify(accelerator.gather({"a": [mine]})),
        "gather_object": operations.gather_object([f"r{rank}"]),
        "broadcast": operations.broadcast(torch.tensor([float(rank + 5)]), from_process=1).tolist(),
        "broadcast_object_list": operations.broadcast_object_list([rank, "x"]),
        "reduce_sum": accelerator.reduce(torch.tensor(rank + 1.0)).item(),
        "reduce_mean": operations.reduce(torch.tensor(rank + 1.0)).item(),
        "reduce_max": accelerator.reduce(torch.tensor(rank + 1.0), reduction="max").item(),
        "pad": accelerator.pad_across_processes(uneven).tolist(),
        "pad_first": accelerator.pad_across_processes(uneven, pad_first=True, pad_index=-1).tolist(),
    }


def process_helpers(accelerator: Accelerator) -> dict[str, Any]:
    with accelerator.split_between_processes(["A", "B", "C"]) as letters:
        split = list(letters)
    with accelerator.split_between_processes(["A", "B", "C"], apply_padding=True) as letters:
        padded = list(letters)
    with accelerator.split_between_processes({"x": torch.arange(5), "y": [0, 1, 2, 3, 4]}, apply_padding=True) as d:
        split_dict = {"x": d["x"].tolist(), "y": d["y"]}

    @accelerator.on_main_process
    def on_main() -> str:
        return "main"

    @accelerator.on_process(process_index=1)
    def on_one() -> str:
        return "one"

    @accelerator.on_last_process
    def on_last() -> str:
        return "last"

    if accelerator.process_index == 1:
        accelerator.set_trigger()
    triggered = [accelerator.check_trigger(), accelerator.check_trigger()]
    set_seed(10, device_specific=True)
    seeded = torch.rand(1).item()
    synchronize_rng_state("torch")
    synced = torch.rand(1).item()
    return {
        "seeded": seeded,
        "synced": synced,
        "split": split,
        "padded": padded,
        "split_dict": split_dict,
        "decorated": [on_main(), on_one(), on_last()],
        "triggered": triggered,
    }


def sync_control(accelerator: Accelerator) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.full((1, 2), float(accelerator.process_index + 1))
    with accelerator.no_sync(model):
        accelerator.backward(model(x).sum())
    local = model.weight.grad.clone()
    optimizer.zero_grad()
    accelerator.backward(model(x).sum())
    return {"no_sync_grad": local.tolist(), "synced_grad": model.weight.grad.tolist()}


def metrics(accelerator: Accelerator) -> dict[str, Any]:
    data = DataLoader(TensorDataset(torch.arange(11.0)), batch_size=4)
    data = accelerator.prepare(data)
    gathered = [accelerator.gather_for_metrics(x) for (x,) in data]
    return {"metric_samples": torch.cat(gathered).tolist(), "batches": len(data)}


def order(accelerator: Accelerator, out: Path) -> list[str]:
    log = out / "order.txt"
    with accelerator.main_process_first(), log.open("a") as f:
        f.write(f"{accelerator.process_index}\n")
    accelerator.wait_for_everyone()
    return log.read_text().split()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out: Path = parser.parse_args().out
    os.environ["ACCELERATE_DEBUG_MODE"] = "true"  # as `accelerate launch --debug` sets it
    accelerator = Accelerator(cpu=True)
    facts: dict[str, Any] = {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "use_distributed": accelerator.use_distributed,
        "is_main_process": accelerator.is_main_process,
        "is_last_process": accelerator.is_last_process,
    }
    facts.update(collectives(accelerator))
    facts.update(sync_control(accelerator))
    facts.update(process_helpers(accelerator))
    facts.update(metrics(accelerator))
    facts["order"] = order(accelerator, out)
    facts["debug"] = accelerator.state.debug
    try:
        accelerator.gather(torch.zeros(accelerator.process_index + 1))
    except operations.DistributedOperationException as err:
        facts["mismatch"] = str(err)
    torch.save(facts, out / f"ops_rank{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
