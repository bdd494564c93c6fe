"""Checkpoints on node-local disks: one process per "node", started by ``lightning-accel launch --num_machines 2``.

Each node runs in its own working directory, and every checkpoint path here is relative, so the two nodes write to
different folders as two machines with their own disks would (the paths that rank 0 broadcasts resolve on each
node's disk). Facts go to the shared ``--out`` as ``rank<global rank>.json`` (and ``.pt`` for tensors):

1. Trainer (``trainer_kwargs()``: DDP on CPU) with two ``CheckpointRotation`` callbacks, ``each_node/`` with
   ``save_on_each_node=True`` and ``main_only/`` without, saving after each of 2 steps with ``total_limit=1``: what
   each node's folders hold and the weights of the checkpoint found there.
2. Trainer with ``acc_fsdp`` (FSDP2, ``SHARDED_STATE_DICT``) and ``CheckpointRotation`` with
   ``save_on_each_node=True`` in ``fsdp_each_node/``: 2 steps, a checkpoint folder after each, ``total_limit=1``; what
   each node's folder holds, then a fresh Trainer (other initial weights) resumes from it with ``ckpt_path="last"``
   and reports the weights it loaded (gathered on every rank) next to the trained ones.
3. The shim, ``Accelerator`` with FSDP2 and ``SHARDED_STATE_DICT``, ``project_dir="shim"``, ``save_on_each_node=True``:
   trains 2 steps, ``save_state()``, lists the files of the checkpoint on this node, trains on, ``load_state()`` and
   reports the weights (gathered on every rank) at the save and after the load, or the error the load raised.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel import Accelerator, trainer_kwargs
from lightning_accel.callbacks import CheckpointRotation, complete_checkpoints
from lightning_accel.config import ProjectConfiguration
from lightning_accel.strategies import AcceleratedFSDPStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))


def rotation(folder: str, save_on_each_node: bool) -> CheckpointRotation:
    config = ProjectConfiguration(
        folder, automatic_checkpoint_naming=True, total_limit=1, save_on_each_node=save_on_each_node
    )
    return CheckpointRotation(config, every_n_train_steps=1)


def trainer_part() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    module = Regressor()
    trainer = L.Trainer(
        **trainer_kwargs(),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation("each_node", True), rotation("main_only", False)],
    )
    trainer.fit(module, DataLoader(data(), batch_size=4))
    facts: dict[str, Any] = {
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "num_nodes": trainer.num_nodes,
        "distributed_type": str(getattr(getattr(trainer.strategy, "distributed_type", None), "value", None)),
        "steps": trainer.global_step,
    }
    tensors: dict[str, Any] = {"trained": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    for folder in ("each_node", "main_only"):
        found = complete_checkpoints(Path(folder) / "checkpoints")
        facts[folder] = [p.name for p in found]
        facts[f"{folder}_incomplete"] = sorted(p.name for p in Path(folder, "checkpoints").glob(".*"))
        if found:
            checkpoint = torch.load(found[-1], map_location="cpu", weights_only=False)
            facts[f"{folder}_global_step"] = checkpoint["global_step"]
            tensors[folder] = checkpoint["state_dict"]
    return facts, tensors


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered weights on every rank (FSDP2 parameters are DTensors; gathering is collective)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def files_of(path: Path) -> list[str]:
    """Every file under ``path``, relative to it (``[]`` if it is not a folder)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def fsdp_trainer(module: Regressor, max_steps: int) -> L.Trainer:
    kwargs = trainer_kwargs()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    kwargs["strategy"] = AcceleratedFSDPStrategy(plugin)
    trainer = L.Trainer(
        **kwargs,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation("fsdp_each_node", True)],
    )
    return trainer


def trainer_fsdp_part() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    module = Regressor()
    fsdp_trainer(module, 2).fit(module, DataLoader(data(), batch_size=4))
    trained = full_weights(module)
    found = complete_checkpoints(Path("fsdp_each_node") / "checkpoints")
    facts: dict[str, Any] = {
        "fsdp_each_node": [p.name for p in found],
        "fsdp_each_node_incomplete": sorted(p.name for p in Path("fsdp_each_node", "checkpoints").glob(".*")),
        "fsdp_each_node_files": files_of(found[-1]) if found else [],
    }
    torch.manual_seed(1)  # other initial weights: what the resumed module holds comes from the checkpoint
    resumed = Regressor()
    initial = {k: v.detach().clone() for k, v in resumed.state_dict().items()}
    try:
        fsdp_trainer(resumed, 2).fit(resumed, DataLoader(data(), batch_size=4), ckpt_path="last")
        facts["fsdp_resume_error"] = None
    except Exception as err:  # reported for the test to show
        facts["fsdp_resume_error"] = f"{type(err).__name__}: {err}"[:3000]
    loaded = full_weights(resumed)
    return facts, {"fsdp_trained": trained, "fsdp_initial": initial, "fsdp_loaded": loaded}


def shim_part() -> tuple[dict[str, Any], dict[str, Any]]:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    project = ProjectConfiguration("shim", automatic_checkpoint_naming=True, save_on_each_node=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, project_config=project)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = accelerator.prepare(DataLoader(data(), batch_size=4))

    def train(steps: int) -> None:
        for _, (x, y) in zip(range(steps), loader, strict=False):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    train(2)
    saved = full_weights(model)
    path = Path(accelerator.save_state())
    facts: dict[str, Any] = {
        "shim_distributed_type": str(accelerator.distributed_type.value),
        "shim_checkpoint": str(path),
        "shim_files": files_of(path),
        "shim_incomplete": sorted(p.name for p in path.parent.glob(".*")),
    }
    train(2)
    moved = full_weights(model)
    try:
        accelerator.load_state()
        facts["shim_load_error"] = None
    except (Exception, CheckpointException) as err:  # reported for the test to show; DCP raises on every rank
        facts["shim_load_error"] = f"{type(err).__name__}: {err}"[:3000]
    loaded = full_weights(model)
    accelerator.wait_for_everyone()
    return facts, {"shim_saved": saved, "shim_moved": moved, "shim_loaded": loaded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    facts, tensors = trainer_part()
    fsdp_facts, fsdp_tensors = trainer_fsdp_part()
    shim_facts, shim_tensors = shim_part()
    facts.update(fsdp_facts, **shim_facts, cwd=os.getcwd())
    tensors.update(fsdp_tensors)
    out.mkdir(parents=True, exist_ok=True)
    rank = facts["global_rank"]
    torch.save({**tensors, **shim_tensors}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    print(f"RESULT {json.dumps(facts)}", flush=True)


if __name__ == "__main__":
    main()
