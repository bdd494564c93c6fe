"""fp8 (torchao float8) under acc_multi_cpu and acc_fsdp (FSDP2, FSDP1) on 2 CPU processes, Trainer and Fabric.

Run under ``torch.distributed.run``; each rank saves ``{variant}_rank{r}.pt``. fp8 is refused on CPU by every
strategy; this script lifts that one gate with :class:`CPUFP8Precision` (the check only: the strategies, the torchao
conversion and the float8 matmuls are the real ones, torch 2.13 runs ``_scaled_mm`` on CPU), as
``tests/scripts/deepspeed_fp8.py`` runs the real engine on CPU. ``tests/unit/strategies/test_fp8_strategies.py`` runs
``acc_no`` in
its own process with the same pieces.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.precision import BF16Precision, FP8Precision
from lightning_accel.strategies import AcceleratedFSDPStrategy, FabricAcceleratedFSDPStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin

STEPS = 12
BATCH = 8  # per process
LR = 3e-3
FLAGS: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


class CPUFP8Precision(FP8Precision):
    """``FP8Precision`` with its GPU check lifted on CPU, for tests only (float8 on CPU is far slower than bf16)."""

    @override
    def check_device(self, device_type: str) -> None:
        if device_type != "cpu":
            super().check_device(device_type)


def network() -> nn.Sequential:
    torch.manual_seed(0)
    # Dimensions divisible by 16; Accelerate's default filter keeps the first and the last Linear in high precision,
    # so "2" and "4" become Float8Linear.
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Linear(256, 64),
    )


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * 8, 64, generator=g)
    return TensorDataset(x, torch.tanh(x.roll(1, dims=1)))


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def _weight_type(weight: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    return f"DTensor({type(weight._local_tensor).__name__})" if isinstance(weight, DTensor) else type(weight).__name__


def describe(model: nn.Module, losses: list[float], precision: Any) -> dict[str, Any]:
    """What training used: which Linears ran in float8, how their weights were held, and the losses."""
    from torchao.float8.float8_linear import Float8Linear

    float8 = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    return {
        "losses": losses,
        "plugin": type(precision).__name__,
        "float8_linears": sorted(float8),
        "float8_weight_types": sorted(_weight_type(m.weight) for m in float8.values()),
        "step_hooks": 0,
    }


def strategy(fsdp: dict[str, Any] | None, fabric: bool = False) -> Any:
    if fsdp is None:
        return "acc_multi_cpu"
    plugin = FullyShardedDataParallelPlugin(**fsdp)
    return FabricAcceleratedFSDPStrategy(plugin) if fabric else AcceleratedFSDPStrategy(plugin)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.losses: list[float] = []
        self.trained_as = ""

    @override
    def on_train_start(self) -> None:
        self.trained_as = type(self.trainer.strategy.model).__name__  # the wrapper (DDP's goes away at teardown)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_of(self.net(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def trainer_run(fsdp: dict[str, Any] | None, precision: Any) -> dict[str, Any]:
    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(fsdp), plugins=[precision], max_steps=STEPS, **FLAGS
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    assert trainer.strategy.model is not None
    result = describe(trainer.strategy.model, module.losses, trainer.strategy.precision_plugin)
    result["step_hooks"] = len(trainer.strategy.optimizers[0]._optimizer_step_post_hooks)
    result["trained_as"] = module.trained_as
    return result


def fabric_run(fsdp: dict[str, Any] | None, precision: Any, out: Path) -> dict[str, Any]:
    """A plain loop; under DDP the optimizer is created before ``fabric.setup`` converts the model (it must still
    train the converted Linears), under FSDP after ``setup_module`` (FSDP replaces the parameters)."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy(fsdp, fabric=True), plugins=[precision])
    fabric.launch()
    if fsdp is None:
        net = network()
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
    else:
        model = fabric.setup_module(network())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH))
    losses: list[float] = []
    while len(losses) < STEPS:
        for x, y in loader:
            loss = loss_of(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    result = describe(model, losses[:STEPS], fabric.strategy.precision)
    result["step_hooks"] = len(optimizer.optimizer._optimizer_step_post_hooks)
    result["trained_as"] = type(model._forward_module).__name__
    if fsdp is not None and fsdp["fsdp_version"] == 2:
        result["reload"] = reload_check(fabric, model, optimizer, out / "fsdp2_fp8_checkpoint")
    return result


def float8_scales(model: nn.Module) -> list[float]:
    """The float8 weight scales precomputed after the last optimizer step (FSDP2 float8 all-gather)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_accel.precision.fp8 import float8_all_gather_modules

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the root stays gathered after a forward without backward
    return [float(m.weight._local_tensor._precomputed_scale) for m in float8_all_gather_modules(model)]


def reload_check(fabric: L.Fabric, model: Any, optimizer: Any, path: Path) -> dict[str, Any]:
    """Save, take one more step, load the checkpoint back: the weights' float8 scales must be the saved weights'."""
    x, y = dataset().tensors
    x, y = x[:BATCH], y[:BATCH]
    with torch.no_grad():
        saved_output = model(x).float()
    saved_scales = float8_scales(model)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.backward(loss_of(model(x), y))
    optimizer.step()
    stepped_scales = float8_scales(model)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    with torch.no_grad():
        loaded_output = model(x).float()
    return {
        "saved_scales": saved_scales,
        "stepped_scales": stepped_scales,
        "loaded_scales": float8_scales(model),
        "same_output": torch.equal(saved_output, loaded_output),
    }


FSDP2 = {"fsdp_version": 2}
FSDP1 = {"fsdp_version": 1}
# FSDP with fp32 parameters and gradient reduction (the rest as Accelerate's fp8): the numbers DDP computes.
FSDP2_FP32 = {"fsdp_version": 2, "mixed_precision_policy": "fp32"}
FSDP1_FP32 = {"fsdp_version": 1, "mixed_precision_policy": "fp32"}


def runs(out: Path) -> dict[str, Any]:
    return {
        "ddp_trainer": lambda: trainer_run(None, CPUFP8Precision()),
        "ddp_bf16_trainer": lambda: trainer_run(None, BF16Precision()),
        "fsdp2_trainer": lambda: trainer_run(FSDP2, CPUFP8Precision()),
        "fsdp1_trainer": lambda: trainer_run(FSDP1, CPUFP8Precision()),
        "fsdp2_fp32_trainer": lambda: trainer_run(FSDP2_FP32, CPUFP8Precision()),
        "fsdp1_fp32_trainer": lambda: trainer_run(FSDP1_FP32, CPUFP8Precision()),
        "ddp_fabric": lambda: fabric_run(None, CPUFP8Precision(), out),
        "fsdp2_fabric": lambda: fabric_run(FSDP2, CPUFP8Precision(), out),
        "fsdp1_fabric": lambda: fabric_run(FSDP1, CPUFP8Precision(), out),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    for name, run in runs(out).items():
        torch.save(run(), out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
