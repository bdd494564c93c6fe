"""``complete_on_each_node`` on 2 processes of one node (torchrun), with folders standing in for disks.

Each case reports, per rank, the plan and what the folders hold afterwards, to ``--out/<case>_rank<r>.pt``:

1. ``save_state``: ``Accelerator`` with FSDP2 ``SHARDED_STATE_DICT`` and ``save_on_each_node=True`` on this one node
   (one shared folder): the plan that ``save_state`` made (empty), the checkpoint's files, and ``load_state``
   restoring the saved weights. Its process group serves the cases below.
2. ``local``: each rank is the manager of its own folder (as each node's local main process on its own disk), small
   chunks (a file spans several messages), nested and empty files; afterwards both folders hold every file.
3. ``shared``: both ranks manage the same folder (shared storage seen by two nodes): nothing to copy.
4. ``one_node``: only rank 0 manages (one node): nothing to copy.
5. ``failure``: rank 1's folder has a directory where rank 0 has a file, and the other way round: both writes fail,
   and both ranks raise (in time, not at the process group's timeout).
6. ``sender_failure``: rank 0's read comes up short mid-file: rank 1 discards what it received, both ranks raise.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.checkpoint import node_copies
from lightning_accel.checkpoint.node_copies import FileCopy, complete_on_each_node, list_files

CHUNK = 1000


def contents(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in list_files(folder)}


def plan_facts(plan: list[FileCopy]) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(c.path, c.size, c.source, c.destinations) for c in plan]


def local_case(root: Path, rank: int) -> dict[str, Any]:
    folder = root / "local" / f"disk{rank}"
    (folder / "shard").mkdir(parents=True)
    (folder / "common.txt").write_text("both nodes write this")
    (folder / "shard" / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * (rank + 1) * 10)  # 2560 / 5120 B
    if rank == 0:
        (folder / "shard" / ".metadata").write_bytes(os.urandom(3 * CHUNK + 5))
        (folder / "empty").write_bytes(b"")
    dist.barrier()
    plan = complete_on_each_node(folder, node_manager=True, chunk_bytes=CHUNK)
    dist.barrier()
    return {"plan": plan_facts(plan), "contents": contents(folder)}


def shared_case(root: Path, rank: int) -> dict[str, Any]:
    folder = root / "shared"
    (folder / "shard").mkdir(parents=True, exist_ok=True)
    (folder / "shard" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 100)
    if rank == 0:
        (folder / "shard" / ".metadata").write_bytes(b"metadata")
    dist.barrier()
    before = contents(folder)
    plan = complete_on_each_node(folder, node_manager=True, chunk_bytes=CHUNK)
    dist.barrier()
    return {"plan": plan_facts(plan), "before": before, "contents": contents(folder)}


def one_node_case(root: Path, rank: int) -> dict[str, Any]:
    folder = root / "one_node"
    folder.mkdir(exist_ok=True)
    (folder / f"random_states_{rank}.pkl").write_bytes(b"x")
    dist.barrier()
    plan = complete_on_each_node(folder, node_manager=rank == 0)
    return {"plan": plan_facts(plan)}


def failure_case(root: Path, rank: int) -> dict[str, Any]:
    folder = root / "failure" / f"disk{rank}"
    folder.mkdir(parents=True)
    mine, theirs = ("x.bin", "y.bin") if rank == 0 else ("y.bin", "x.bin")
    (folder / mine).write_bytes(b"a file here")
    (folder / theirs / "inner").mkdir(parents=True)  # a non-empty folder where the other disk has a file
    (folder / theirs / "inner" / "f").write_bytes(b"")
    dist.barrier()
    try:
        complete_on_each_node(folder, node_manager=True, what="the failure case")
    except OSError as err:
        return {"error": f"{type(err).__name__}: {err}", "notes": getattr(err, "__notes__", []), "rank": rank}
    return {"error": None}


def sender_failure_case(root: Path, rank: int) -> dict[str, Any]:
    """Rank 0 lists a file as longer than it is (as if it shrank before it was sent): its read comes up short."""
    folder = root / "sender_failure" / f"disk{rank}"
    folder.mkdir(parents=True)
    if rank == 0:
        (folder / "shard.distcp").write_bytes(b"s" * 2500)
    dist.barrier()
    real = node_copies.list_files
    if rank == 0:
        node_copies.list_files = lambda path: {name: size + 10 for name, size in real(path).items()}  # type: ignore[assignment]
    try:
        complete_on_each_node(folder, node_manager=True, chunk_bytes=CHUNK, what="the sender failure case")
    except RuntimeError as err:
        return {"error": str(err), "files": sorted(p.name for p in folder.rglob("*"))}  # partial copies too
    finally:
        node_copies.list_files = real  # type: ignore[assignment]
    return {"error": None, "files": sorted(p.name for p in folder.rglob("*"))}


def save_state_case(root: Path) -> dict[str, Any]:
    from lightning_accel import Accelerator
    from lightning_accel._accelerator import checkpoints as checkpoint_control
    from lightning_accel.config import ProjectConfiguration
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    plans: list[list[FileCopy]] = []

    def spy(folder: Path, **kwargs: Any) -> list[FileCopy]:
        plan = complete_on_each_node(folder, **kwargs)
        plans.append(plan)
        return plan

    checkpoint_control.complete_on_each_node = spy  # type: ignore[assignment]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    project = ProjectConfiguration(str(root / "shim"), automatic_checkpoint_naming=True, save_on_each_node=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, project_config=project)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.randn(16, 8, generator=g)), batch_size=4))

    def train() -> None:
        for (x,) in loader:
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}

    train()
    saved = weights()
    path = Path(accelerator.save_state())
    files = sorted(list_files(path))
    train()
    moved = weights()
    accelerator.load_state()
    return {
        "plans": [plan_facts(p) for p in plans],
        "files": files,
        "saved": saved,
        "moved": moved,
        "loaded": weights(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    results = {"save_state": save_state_case(out / "disks")}  # the Accelerator joins the process group
    rank = dist.get_rank()
    root = out / "disks"
    results["local"] = local_case(root, rank)
    results["shared"] = shared_case(root, rank)
    results["one_node"] = one_node_case(root, rank)
    results["failure"] = failure_case(root, rank)
    results["sender_failure"] = sender_failure_case(root, rank)
    dist.barrier()
    for case, result in results.items():
        torch.save(result, out / f"{case}_rank{rank}.pt")


if __name__ == "__main__":
    main()
