"""``acc_parallel`` on CPU processes (gloo) against a single-process PyTorch run of the same model and data.

Run under ``torch.distributed.run`` with 2 processes (``--layout 2``: tp=2, and dp_replicate=2) or 4 (``--layout 4``:
dp_shard=2 x tp=2, and dp_replicate=2 x dp_shard=2). Each rank saves ``{variant}_rank{r}.pt`` with the losses averaged
over the data-parallel processes, the full weights, the reference run's losses and weights, and what the strategy
reported (mesh, ranks, sampler arguments, the placements of a weight).
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_accel
from lightning_accel.strategies import AcceleratedParallelStrategy
from lightning_accel.utils import FullyShardedDataParallelPlugin, ParallelismConfig

BATCH = 4  # per data-parallel process
SAMPLES = 32
LR = 0.1
PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    2: {"tp": {"tp_size": 2}, "replicate": {"dp_replicate_size": 2}},
    4: {"dp_shard_tp": {"dp_shard_size": 2, "tp_size": 2}, "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2}},
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 4, generator=generator))


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def global_batches(dp_size: int, epoch: int, shuffle: bool) -> list[list[int]]:
    """The samples of each step over all data-parallel processes, in the order their ``DistributedSampler`` gives.

    The Trainer always shuffles training data with ``DistributedSampler(seed=0)`` (``set_epoch`` each epoch); the
    Fabric loop keeps its loader's order.
    """
    per_rank = []
    for rank in range(dp_size):
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset(), num_replicas=dp_size, rank=rank, shuffle=shuffle, seed=0
        )
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    steps = len(per_rank[0]) // BATCH
    return [[i for r in per_rank for i in r[k * BATCH : (k + 1) * BATCH]] for k in range(steps)]


def reference(dp_size: int, epochs: int, shuffle: bool) -> dict[str, Any]:
    """One process, the global batch (every data-parallel process's batch together) at each step."""
    model, (xs, ys) = MLP(), dataset().tensors
    opt = optimizer(model.parameters())
    losses = []
    for epoch in range(epochs):
        for indices in global_batches(dp_size, epoch, shuffle):
            x, y = xs[indices], ys[indices]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class Regressor(L.LightningModule):
    def __init__(self, apply_plan: bool) -> None:
        super().__init__()
        self.net = MLP()
        self.apply_plan = apply_plan
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        # Lightning's pattern: the strategy's mesh, tensor parallelism on its "tp" dimension.
        if self.apply_plan and not isinstance(self.net.w1.weight, DTensor):
            assert self.device_mesh is not None
            parallelize_module(self.net, self.device_mesh["tp"], PLAN)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters())


def mean_over_processes(values: list[torch.Tensor] | list[float]) -> list[float]:
    """Average over all processes (tensor- and context-parallel ones hold the same value, so this is the dp mean)."""
    stacked = torch.tensor([float(v) for v in values])
    dist.all_reduce(stacked)
    return (stacked / dist.get_world_size()).tolist()


def full_weights(strategy: Any, model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    full = strategy._parallel.checkpoints.model_state_dict(model, full=True)
    return {k.removeprefix(prefix): v.detach().clone() for k, v in full.items()}


def describe(strategy: Any, model: nn.Module) -> dict[str, Any]:
    weight = dict(model.named_parameters())[next(n for n, _ in model.named_parameters() if n.endswith("w1.weight"))]
    mesh = strategy.torch_device_mesh
    return {
        "strategy_class": type(strategy).__name__,
        "distributed_type": str(strategy.distributed_type),
        "mesh_dims": tuple(mesh.mesh_dim_names),
        "mesh_shape": tuple(mesh.shape),
        "placements": [str(p) for p in weight.placements] if isinstance(weight, DTensor) else [],
        "local_numel": weight.to_local().numel() if isinstance(weight, DTensor) else weight.numel(),
        "ranks": {
            "tp": strategy.tensor_parallel_rank,
            "dp_shard": strategy.data_parallel_shard_rank,
            "dp_replicate": strategy.data_parallel_rank,
            "cp": strategy.context_parallel_rank,
        },
        "sampler": strategy.distributed_sampler_kwargs,
        "fsdp_units": sum(type(m).__name__.startswith("FSDP") for m in model.modules()),
    }


def trainer_fit(sizes: dict[str, Any], epochs: int, use_tp_plan: bool, ckpt_path: str | None = None) -> Any:
    module = Regressor(apply_plan=sizes.get("tp_size", 1) > 1 and not use_tp_plan)
    strategy = AcceleratedParallelStrategy(
        ParallelismConfig(**sizes), tp_plan={f"net.{k}": v for k, v in PLAN.items()} if use_tp_plan else None
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, module


def trainer_result(trainer: L.Trainer, module: Regressor) -> dict[str, Any]:
    strategy = trainer.strategy
    return {
        "losses": mean_over_processes(module.losses),
        "weights": full_weights(strategy, strategy.model, prefix="net."),  # type: ignore[arg-type]
        **describe(strategy, module),
    }


def trainer_resume(sizes: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    trainer, module = trainer_fit(sizes, epochs=1, use_tp_plan=True)
    ckpt = out / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt)
    first = mean_over_processes(module.losses)
    trainer, resumed = trainer_fit(sizes, epochs=2, use_tp_plan=True, ckpt_path=str(ckpt))
    return {**trainer_result(trainer, resumed), "first_losses": first}


def fabric_run(sizes: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return parallelize_module(model, mesh["tp"], PLAN) if sizes.get("tp_size", 1) > 1 else model

    chosen = lightning_accel.strategies.FabricAcceleratedParallelStrategy(
        ParallelismConfig(**sizes), parallelize_fn=parallelize
    )
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=chosen)
    fabric.launch()
    plain = MLP()
    model, opt = fabric.setup(plain, optimizer(plain.parameters()))  # one call, optimizer of the plain model
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH))
    losses = []
    for _ in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            losses.append(loss.item())
    strategy = fabric.strategy
    weights = full_weights(strategy, model._forward_module)
    path = out / f"{name}.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": len(losses)})
    fresh = MLP()
    fresh_model, fresh_opt = fabric.setup(fresh, optimizer(fresh.parameters()))
    state = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
    fabric.load(path, state)
    momentum = [s["momentum_buffer"] for s in opt.optimizer.state.values()]
    reloaded_momentum = [s["momentum_buffer"] for s in fresh_opt.optimizer.state.values()]
    return {
        "losses": mean_over_processes(losses),
        "weights": weights,
        "reloaded_weights": full_weights(strategy, fresh_model._forward_module),
        "reloaded_step": state["step"],
        "momentum_restored": len(momentum) == len(reloaded_momentum) > 0
        and all(
            torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(momentum, reloaded_momentum, strict=True)
        ),
        **describe(strategy, model._forward_module),
    }


def fabric_full_checkpoint(out: Path) -> dict[str, Any]:
    """tp=2 with ``FULL_STATE_DICT``: rank 0 writes one file, which loads back into a fresh tensor-parallel model."""

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return parallelize_module(model, mesh["tp"], PLAN)

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    strategy = lightning_accel.strategies.FabricAcceleratedParallelStrategy(
        ParallelismConfig(tp_size=2), parallelize_fn=parallelize, fsdp_plugin=plugin
    )
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    plain = MLP()
    model, opt = fabric.setup(plain, optimizer(plain.parameters()))
    for x, y in fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH)):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    path = out / "fabric_tp_full.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    fresh = MLP()
    fresh_model, fresh_opt = fabric.setup(fresh, optimizer(fresh.parameters()))
    fabric.load(path, {"model": fresh_model, "optimizer": fresh_opt})
    return {
        "weights": full_weights(strategy, model._forward_module),
        "reloaded_weights": full_weights(strategy, fresh_model._forward_module),
    }


def missing_plan_error() -> str:
    """What ``setup_module`` says when tp_size > 1 but nothing applied tensor parallelism."""
    fabric = L.Fabric(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=lightning_accel.strategies.FabricAcceleratedParallelStrategy(ParallelismConfig(tp_size=2)),
    )
    fabric.launch()
    try:
        fabric.setup_module(MLP())
    except ValueError as err:
        return str(err)
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", type=int, choices=sorted(LAYOUTS), required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    results: dict[str, dict[str, Any]] = {}
    (split_name, split), (data_name, data_only) = LAYOUTS[args.layout].items()
    dp_split = split.get("dp_replicate_size", 1) * split.get("dp_shard_size", 1)
    results[split_name] = trainer_result(*trainer_fit(split, epochs=2, use_tp_plan=False))
    results[f"{split_name}_resume"] = trainer_resume(split, args.out, f"{split_name}_resume")
    results[f"fabric_{split_name}"] = fabric_run(split, args.out, f"fabric_{split_name}")
    results[data_name] = trainer_result(*trainer_fit(data_only, epochs=2, use_tp_plan=False))
    results[f"reference_{split_name}"] = reference(dp_split, epochs=2, shuffle=True)
    results[f"reference_fabric_{split_name}"] = reference(dp_split, epochs=2, shuffle=False)
    results[f"reference_{data_name}"] = reference(dist.get_world_size(), epochs=2, shuffle=True)
    if args.layout == 2:
        results["missing_plan"] = {"error": missing_plan_error()}
        results["fabric_tp_full"] = fabric_full_checkpoint(args.out)
    for variant, value in results.items():
        torch.save(value, args.out / f"{variant}_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
