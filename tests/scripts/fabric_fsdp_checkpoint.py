"""Fabric checkpoints of ``acc_fsdp``, ``acc_parallel`` and ``acc_deepspeed_stage_2`` against Lightning's ``ddp``.

Per strategy, on 2 CPU processes: train with a torchdata ``StatefulDataLoader``, ``fabric.save`` mid-way, go on, then
load the checkpoint into fresh objects and train the rest again (the loader must resume where it stopped);
``fabric.load_raw`` of a plain ``torch.save(model.state_dict())`` file into the set-up model;
``fabric.init_module(empty_init=True)``. ``acc_deepspeed``'s Fabric checkpoints are Lightning's DeepSpeed code, checked
here for the same gap. Run under ``torch.distributed.run``; each rank saves ``{variant}_rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_accel
from lightning_accel.utils import FullyShardedDataParallelPlugin, ParallelismConfig

STEPS, SAVE_AT = 6, 3
VARIANTS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "fsdp2_sharded": {"fsdp_version": 2},
    "fsdp2_full": {"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT"},
    "fsdp1_full": {"fsdp_version": 1, "state_dict_type": "FULL_STATE_DICT", "use_orig_params": True},
    "parallel": {},
    "deepspeed": {},  # Lightning's own DeepSpeed checkpoint code (acc_deepspeed inherits it)
}


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))


def make_fabric(variant: str) -> L.Fabric:
    options = VARIANTS[variant]
    if options is None:
        chosen: Any = "ddp"
    elif variant == "deepspeed":
        chosen = "acc_deepspeed_stage_2"
    elif variant == "parallel":
        chosen = lightning_accel.strategies.FabricAcceleratedParallelStrategy(ParallelismConfig(dp_shard_size=2))
    else:
        plugin = FullyShardedDataParallelPlugin(**options)
        chosen = lightning_accel.strategy_for("FSDP", fabric=True, fsdp_plugin=plugin)
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=chosen)
    fabric.launch()
    return fabric


def full_weights(fabric: L.Fabric, model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = model._forward_module
    if isinstance(module, nn.parallel.DistributedDataParallel) or type(module).__name__ == "DeepSpeedEngine":
        return {k: v.detach().clone() for k, v in module.module.state_dict().items()}
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def setup(fabric: L.Fabric) -> tuple[Any, Any, Any]:
    fabric.seed_everything(7)
    if type(fabric.strategy).__name__ == "FabricAcceleratedDeepSpeedStrategy":  # DeepSpeed sets both up at once
        plain = network()
        model, optimizer = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=0.05))
    else:
        model = fabric.setup_module(network())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    sampler = DistributedSampler(dataset(), num_replicas=fabric.world_size, rank=fabric.global_rank, seed=3)
    loader = fabric.setup_dataloaders(StatefulDataLoader(dataset(), batch_size=4, sampler=sampler))
    return model, optimizer, loader


def train(fabric: L.Fabric, model: Any, optimizer: Any, batches: Any, steps: int) -> tuple[list[float], list[Any]]:
    losses, seen = [], []
    for _, (x, y) in zip(range(steps), batches, strict=False):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss, model=model)  # DeepSpeed, with two engines set up, asks which one
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        seen.append(x.clone())
    return losses, seen


def save_and_resume(variant: str, out: Path) -> dict[str, Any]:
    fabric = make_fabric(variant)
    model, optimizer, loader = setup(fabric)
    batches = iter(loader)
    losses, seen = train(fabric, model, optimizer, batches, SAVE_AT)
    path = out / f"{variant}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "loader": loader, "step": SAVE_AT})
    more, seen_more = train(fabric, model, optimizer, batches, STEPS - SAVE_AT)
    weights = full_weights(fabric, model)

    model, optimizer, loader = setup(fabric)  # fresh objects, the loader at its first batch
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    remainder = fabric.load(path, state)
    resumed, seen_resumed = train(fabric, model, optimizer, iter(loader), STEPS - SAVE_AT)
    return {
        "losses": losses + more,
        "weights": weights,
        "resumed_losses": resumed,
        "resumed_weights": full_weights(fabric, model),
        "batches_after_save": torch.stack(seen_more),
        "batches_after_load": torch.stack(seen_resumed),
        "step": state["step"],
        "remainder": sorted(remainder),
        "first_batches": torch.stack(seen),
    }


def load_raw(variant: str, out: Path) -> dict[str, Any]:
    fabric = make_fabric(variant)
    torch.manual_seed(11)
    plain = network()
    path = out / "raw.pt"
    if fabric.global_rank == 0:
        torch.save(plain.state_dict(), path)
    fabric.barrier()
    fabric.seed_everything(5)
    model = fabric.setup_module(network())
    fabric.load_raw(path, model)
    errors = []
    if variant != "ddp":
        for target, obj in ((out, model), (path, torch.optim.SGD(network().parameters(), lr=0.1))):
            try:
                fabric.load_raw(target, obj)
            except ValueError as err:
                errors.append(str(err))
    return {"loaded": full_weights(fabric, model), "file": plain.state_dict(), "errors": errors}


def empty_init(variant: str) -> dict[str, Any]:
    from lightning.fabric.strategies import FSDPStrategy

    fabric = make_fabric(variant)
    with fabric.init_module(empty_init=True):
        model = network()
    on_meta = all(p.is_meta for p in model.parameters())
    fabric.seed_everything(13)
    set_up = fabric.setup_module(model)  # materialized here: each Linear's reset_parameters() draws its weights
    fabric.seed_everything(13)
    expected = network().state_dict()  # Linear's constructor draws the same numbers in the same order
    return {
        "on_meta": on_meta,
        "weights": full_weights(fabric, set_up),
        "expected": expected,
        "is_lightning_fsdp": isinstance(fabric.strategy, FSDPStrategy),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    runs: dict[str, Any] = {}
    for variant in VARIANTS:
        runs[f"resume_{variant}"] = lambda v=variant: save_and_resume(v, out)
    for variant in ("ddp", "fsdp2_full", "fsdp1_full", "parallel"):
        runs[f"raw_{variant}"] = lambda v=variant: load_raw(v, out)
    runs["empty_init_fsdp2_full"] = lambda: empty_init("fsdp2_full")
    runs["empty_init_fsdp1_full"] = lambda: empty_init("fsdp1_full")
    for name, run in runs.items():
        torch.save(run(), out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
