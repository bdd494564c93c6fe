"""``acc_fsdp`` (FSDP1 and FSDP2) against Lightning's ``ddp`` on 2 CPU processes: training, accumulation, sharding,
checkpoints and resume. Run under ``torch.distributed.run``; each rank saves ``{variant}_rank{r}.pt``.
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
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.utils.data import DataLoader

import lightning_accel
from lightning_accel.strategies import AcceleratedFSDPStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin
from tests.scripts.ddp_parity import Regressor, dataset, network

RUN: dict[str, Any] = {"accelerator": "cpu", "devices": 2}
FSDP2 = {"fsdp_version": 2}
FSDP2_UNITS = {"fsdp_version": 2, "auto_wrap_policy": "size_based_wrap", "min_num_params": 100}
FSDP1_FULL = {"fsdp_version": 1, "state_dict_type": "FULL_STATE_DICT"}
FSDP2_OPTIONS = {
    "fsdp_version": 2,
    "auto_wrap_policy": "transformer_based_wrap",
    "transformer_cls_names_to_wrap": ["Linear"],
    "activation_checkpointing": True,
    "reshard_after_forward": False,
}
FSDP1_OPTIONS = {
    "fsdp_version": 1,
    "sharding_strategy": "SHARD_GRAD_OP",
    "auto_wrap_policy": "size_based_wrap",
    "min_num_params": 100,
    "backward_prefetch": "BACKWARD_POST",
    "forward_prefetch": True,
    "limit_all_gathers": False,
    "use_orig_params": True,
    "sync_module_states": True,
}


def strategy(options: dict[str, Any] | None) -> Any:
    return "ddp" if options is None else AcceleratedFSDPStrategy(FullyShardedDataParallelPlugin(**options))


def local_fraction(model: nn.Module) -> float:
    """Share of the parameter elements this process holds."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return local / sum(p.numel() for p in network().parameters())


class WeightsAtTrainStart(L.Callback):
    """The full weights every rank holds once the strategy has set the model up (before the first step)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        full = trainer.strategy._fsdp.model_state_dict(trainer.strategy.model, full=True)  # type: ignore[attr-defined]
        self.weights = {k.removeprefix("net."): v.detach().clone() for k, v in full.items()}


def fit(
    options: dict[str, Any] | None,
    epochs: int,
    accumulate: int = 1,
    ckpt_path: str | None = None,
    callbacks: list[L.Callback] | None = None,
    other_weights_off_rank_0: bool = False,
) -> Any:
    L.seed_everything(42)
    module = Regressor()
    if other_weights_off_rank_0 and int(os.environ["RANK"]) != 0:
        with torch.no_grad():  # no random numbers drawn: rank 0 keeps the reference's start, the others differ
            for param in module.parameters():
                param.add_(0.5)
    module.initial_weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    trainer = L.Trainer(
        accelerator=RUN["accelerator"],
        devices=RUN["devices"],
        strategy=strategy(options),
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return trainer, module


def result(trainer: L.Trainer, module: Regressor, options: dict[str, Any] | None) -> dict[str, Any]:
    if options is None:
        weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    else:
        full = trainer.strategy._fsdp.model_state_dict(trainer.strategy.model, full=True)  # type: ignore[attr-defined]
        weights = {k.removeprefix("net."): v.detach().clone() for k, v in full.items()}
    modules = list(trainer.strategy.model.modules())
    return {
        "losses": module.losses,
        "weights": weights,
        "strategy_class": type(trainer.strategy).__name__,
        "distributed_type": str(getattr(trainer.strategy, "distributed_type", None)),
        "local_fraction": local_fraction(trainer.strategy.model),
        "fsdp_units": sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in modules),
        "checkpoint_wrappers": sum(type(m).__name__.endswith("CheckpointWrapper") for m in modules),
    }


def sync_module_states(options: dict[str, Any]) -> dict[str, Any]:
    """FSDP1 with ``sync_module_states`` from other weights on rank 1: rank 0's must reach every rank."""
    at_start = WeightsAtTrainStart()
    trainer, module = fit(options, epochs=2, callbacks=[at_start], other_weights_off_rank_0=True)
    return {
        **result(trainer, module, options),
        "initial_weights": module.initial_weights,
        "weights_at_train_start": at_start.weights,
    }


def resume(options: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    trainer, module = fit(options, epochs=1)
    ckpt = out / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = result(trainer, module, options)["weights"]
    trainer, resumed = fit(options, epochs=2, ckpt_path=str(ckpt))
    return {**result(trainer, resumed, options), "first_losses": module.losses, "saved_weights": saved}


def fabric(options: dict[str, Any] | None, out: Path, name: str) -> dict[str, Any]:
    chosen = (
        "ddp"
        if options is None
        else lightning_accel.strategy_for("FSDP", fabric=True, fsdp_plugin=FullyShardedDataParallelPlugin(**options))
    )
    f = L.Fabric(accelerator=RUN["accelerator"], devices=RUN["devices"], strategy=chosen)
    f.launch()
    f.seed_everything(42)
    model = f.setup_module(network())
    optimizer = f.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    loader = f.setup_dataloaders(DataLoader(dataset(), batch_size=8, shuffle=True))
    losses = []
    for step, (x, y) in enumerate(loader):
        with f.no_backward_sync(model, enabled=step % 2 == 0):
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            f.backward(loss / 2)
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    if options is None:
        return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    state = f.strategy._fsdp.model_state_dict(model._forward_module, full=True)  # type: ignore[attr-defined]
    return {
        "losses": losses,
        "weights": {k: v.detach().clone() for k, v in state.items()},
        **fabric_round_trip(f, model, optimizer, out / f"{name}.ckpt"),
    }


def fabric_round_trip(f: L.Fabric, model: Any, optimizer: Any, path: Path) -> dict[str, Any]:
    """Save with fabric.save, load into a fresh sharded model and optimizer, report what came back."""
    f.save(path, {"model": model, "optimizer": optimizer, "step": 12})
    fresh = f.setup_module(network())
    fresh_optimizer = f.setup_optimizers(torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9))
    state: dict[str, Any] = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    f.load(path, state)
    reloaded = f.strategy._fsdp.model_state_dict(fresh._forward_module, full=True)  # type: ignore[attr-defined]
    try:
        f.setup(network(), torch.optim.SGD(network().parameters(), lr=0.1))
        setup_error = ""
    except ValueError as err:
        setup_error = str(err)
    return {
        "reloaded_weights": {k: v.detach().clone() for k, v in reloaded.items()},
        "reloaded_step": state["step"],
        "momentum_restored": all(len(s) > 0 for s in fresh_optimizer.state.values()) and len(fresh_optimizer.state) > 0,
        "setup_error": setup_error,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    out = args.out
    RUN.update(accelerator=args.accelerator, devices=int(os.environ["WORLD_SIZE"]))
    runs: dict[str, Any] = {}
    for name, options in {"ddp": None, "fsdp2": FSDP2, "fsdp2_units": FSDP2_UNITS, "fsdp1": FSDP1_FULL}.items():
        runs[name] = lambda o=options: result(*fit(o, epochs=2), o)
        runs[f"{name}_accum"] = lambda o=options: result(*fit(o, epochs=2, accumulate=2), o)
    runs["fsdp2_options"] = lambda: result(*fit(FSDP2_OPTIONS, epochs=2), FSDP2_OPTIONS)
    runs["fsdp1_options"] = lambda: sync_module_states(FSDP1_OPTIONS)
    runs["fsdp2_resume"] = lambda: resume(FSDP2, out, "fsdp2_resume")
    runs["fsdp1_resume"] = lambda: resume(FSDP1_FULL, out, "fsdp1_resume")
    runs["fabric_ddp"] = lambda: fabric(None, out, "fabric_ddp")
    runs["fabric_fsdp2"] = lambda: fabric(FSDP2, out, "fabric_fsdp2")
    runs["fabric_fsdp1"] = lambda: fabric({**FSDP1_FULL, "use_orig_params": True}, out, "fabric_fsdp1")
    for name, run in runs.items():
        torch.save(run(), out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
