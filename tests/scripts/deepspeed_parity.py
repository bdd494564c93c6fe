"""Train the same seeded model under Lightning's ``ddp`` and lightning_accel's DeepSpeed strategies (Trainer, Fabric).

Run under ``torch.distributed.run`` with 2 processes; each rank saves ``{variant}_rank{r}.pt`` with its per-step
losses, the final (gathered) weights and facts about the engine, for ``tests/unit/strategies/test_deepspeed.py`` to
compare. Every
DeepSpeed run also writes a checkpoint at the end of its first epoch; the ``*_resume`` variants continue from it.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.config import DeepSpeedPlugin, TorchDynamoPlugin
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy

EPOCHS = 2
BATCH = 8
# tests/scripts/deepspeed_gpu.py reuses run_trainer on one GPU
ACCELERATOR = "cpu"
DEVICES = 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


def network() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights, gathered from all ranks under ZeRO 3 (a collective then)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if params:
        import deepspeed

        context: Any = deepspeed.zero.GatheredParameters(params)
    else:
        context = nullcontext()
    with context:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Regressor(L.LightningModule):
    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        self.net: nn.Module | None = None if build_in_configure_model else network()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = network()
            # Under deepspeed.zero.Init (zero3_init_flag) the parameters are partitioned as they are created.
            self.built_partitioned = all(hasattr(p, "ds_id") for p in self.net.parameters())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.net is not None
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class Record(L.Callback):
    """Saves a checkpoint after the first epoch (when asked) and records engine facts and final weights."""

    def __init__(self, checkpoint: Path | None) -> None:
        self.checkpoint = checkpoint
        self.facts: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.model
        params = list(pl_module.parameters())
        self.facts.update(
            strategy_class=type(trainer.strategy).__name__,
            world_size=dist.get_world_size(),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            local_numel=sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
            full_numel=sum(getattr(p, "ds_numel", p.numel()) for p in params),
            built_partitioned=getattr(pl_module, "built_partitioned", None),
            compiled=any(getattr(m, "_compiled_call_impl", None) is not None for m in pl_module.modules()),
        )
        if hasattr(engine, "zero_optimization_stage"):
            optimizer = trainer.optimizers[0]
            self.facts.update(
                basic_optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__,
                engine_class=type(engine).__name__,
                zero_stage=engine.zero_optimization_stage(),
                engine_accumulation=engine.gradient_accumulation_steps(),
                engine_clipping=engine.gradient_clipping(),
                engine_micro_batch=engine.train_micro_batch_size_per_gpu(),
                engine_train_batch=engine.train_batch_size(),
            )

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.facts.setdefault("lrs", []).append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint is not None and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.checkpoint)
            self.facts["saved_weights"] = full_weights(pl_module)
            self.facts["saved_step"] = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.facts["weights"] = full_weights(pl_module)
        self.facts["global_step"] = trainer.global_step


def run_trainer(
    strategy: Any,
    *,
    checkpoint: Path | None = None,
    resume: Path | None = None,
    configure_model: bool = False,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    L.seed_everything(42)
    trainer_kwargs.setdefault("max_epochs", EPOCHS)
    module = Regressor(build_in_configure_model=configure_model)
    record = Record(checkpoint)
    trainer = L.Trainer(
        accelerator=ACCELERATOR,
        devices=DEVICES,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=True), ckpt_path=resume)
    return {"losses": module.losses, **record.facts}


def run_fabric(strategy: Any, checkpoint: Path) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    net = network()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    local_numel = sum(p.ds_tensor.numel() for p in net.parameters())
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "epochs": EPOCHS})
    for p in net.parameters():  # the load below must bring the trained values back
        p.ds_tensor.data.zero_()
    remainder = fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    return {
        "loaded_remainder": {k: v for k, v in remainder.items() if k == "epochs"},
        "losses": losses,
        "weights": full_weights(net),
        "strategy_class": type(fabric.strategy).__name__,
        "local_numel": local_numel,
    }


def expect_error(make: Callable[[], Any]) -> dict[str, Any]:
    try:
        make()
    except ValueError as err:
        return {"error_type": "ValueError", "error": str(err)}
    except Exception as err:  # recorded so that the test shows what went wrong
        return {"error_type": type(err).__name__, "error": "".join(traceback.format_exception(err))[-3000:]}
    return {"error_type": None, "error": ""}


# The optimizer and scheduler come from the config; their "auto" values from configure_optimizers (lr 0.5, no decay).
DECLARED = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 4, "warmup_type": "linear"},
    },
    "zero_optimization": {"stage": 2},
}


def plugin(stage: int, dynamo_plugin: TorchDynamoPlugin | None = None, **fields: Any) -> AcceleratedDeepSpeedStrategy:
    return AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=stage, **fields), dynamo_plugin=dynamo_plugin)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out: Path = args.out
    ckpt = {stage: out / f"stage{stage}.ckpt" for stage in (0, 1, 2, 3)}
    accumulate = {"gradient_clip_val": 0.05}
    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "ddp": lambda: run_trainer("ddp"),
        "ddp_accumulate": lambda: run_trainer("ddp", accumulate_grad_batches=4, **accumulate),
        "stage0": lambda: run_trainer(plugin(0), checkpoint=ckpt[0]),
        "stage1": lambda: run_trainer("acc_deepspeed_stage_1", checkpoint=ckpt[1]),
        "stage2": lambda: run_trainer(plugin(2), checkpoint=ckpt[2]),
        "stage3": lambda: run_trainer(plugin(3, zero3_save_16bit_model=True), checkpoint=ckpt[3], configure_model=True),
        "stage3_offload": lambda: run_trainer("acc_deepspeed_stage_3_offload"),
        "stage2_bf16": lambda: run_trainer(plugin(2), precision="bf16-mixed", max_epochs=1),
        "stage2_compiled": lambda: run_trainer(plugin(2, dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))),
        "stage1_resume": lambda: run_trainer("acc_deepspeed_stage_1", resume=ckpt[1]),
        "stage2_resume": lambda: run_trainer(plugin(2), resume=ckpt[2]),
        "stage3_resume": lambda: run_trainer(
            plugin(3, zero3_save_16bit_model=True), resume=ckpt[3], configure_model=True
        ),
        # accumulation from the plugin (the Trainer keeps its default 1), clipping from the Trainer ("auto")
        "stage2_accumulate": lambda: run_trainer(plugin(2, gradient_accumulation_steps=4), **accumulate),
        "declared_optimizer": lambda: run_trainer(plugin(2, hf_ds_config=DECLARED), max_epochs=1),
        "fabric_stage3": lambda: run_fabric(
            FabricAcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=3)), out / "fabric_stage3.ckpt"
        ),
        "conflict_accumulation": lambda: expect_error(
            lambda: run_trainer(plugin(2, gradient_accumulation_steps=4), accumulate_grad_batches=2)
        ),
        "conflict_batch_size": lambda: expect_error(
            lambda: run_trainer(
                plugin(2, hf_ds_config={"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}})
            )
        ),
    }
    for name, run in variants.items():
        result = run()
        torch.save(result, out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
