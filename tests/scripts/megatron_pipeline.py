"""``acc_megatron_lm`` pipeline parallelism on CPU processes (gloo) through megatron-core's own schedules.

Run under ``torch.distributed.run``. With 1 process it trains the reference (``pp1``: Fabric, pp_degree=1, one
forward and backward per batch, no schedule) and writes the model's initial whole weights (``init.pt``). With 2
processes (pp_degree=2, num_micro_batches=2, megatron's 1F1B schedule) every stage starts from those weights (its
layers renamed to the stage's) and trains on the same batches: ``fabric_pp2`` (Fabric; saved after half the steps,
then a fresh model and optimizer load that save and train the second half: ``fabric_pp2_resumed``) and
``trainer_pp2`` (the Trainer, manual optimization). Each rank saves ``{variant}_rank{r}.pt``: the loss the strategy
reported at each step, the stage it ran and its weights under their whole-model names.
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

import lightning_accel  # noqa: F401  (registers the strategy names)
from lightning_accel.checkpoint.megatron import global_layer_names
from lightning_accel.strategies.megatron import AcceleratedMegatronLMStrategy, FabricAcceleratedMegatronLMStrategy
from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import COMMON, GLOBAL_BATCH, STEPS, build, dataset, loss_of, optimizer

HALF = STEPS // 2
PP2 = MegatronLMPlugin(**COMMON, pp_degree=2, num_micro_batches=2, gradient_clipping=0)
PP1 = MegatronLMPlugin(**COMMON, gradient_clipping=0)


def model_output(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    causal = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
    return model(ids, positions, causal, labels=labels)  # per-token loss on the last stage, hidden states elsewhere


def mean_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.mean()


def whole_named(model: nn.Module) -> dict[str, torch.Tensor]:
    names = global_layer_names(model)
    return {names[key]: value.detach().clone() for key, value in model.state_dict().items() if value is not None}


def load_whole(model: nn.Module, whole: dict[str, torch.Tensor]) -> None:
    names = global_layer_names(model)
    model.load_state_dict({key: whole[names[key]] for key in model.state_dict() if names[key] in whole}, strict=False)


def stage() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def batches(fabric: L.Fabric) -> list[Any]:
    from torch.utils.data import DataLoader

    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=True))
    return list(loader)[:STEPS]


def run_reference(out: Path) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricAcceleratedMegatronLMStrategy(PP1))
    fabric.launch()
    model = build(PP1, cpu_attention=True)
    torch.save(whole_named(model), out / "init.pt")
    wrapped, opt = fabric.setup(model, optimizer(model.parameters()))
    losses = []
    for batch in batches(fabric):
        loss = loss_of(wrapped, batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    result = {"losses": losses, "weights": whole_named(model), "stage": stage()}
    fabric.strategy.teardown()
    return result


def train(fabric: L.Fabric, model: Any, opt: Any, steps: list[Any]) -> list[float]:
    losses = []
    for batch in steps:
        strategy = fabric.strategy
        assert isinstance(strategy, FabricAcceleratedMegatronLMStrategy)
        loss = strategy.pipeline_step(model, batch, model_output, mean_loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def run_fabric_pp2(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    strategy = FabricAcceleratedMegatronLMStrategy(PP2)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    init = torch.load(out / "init.pt")
    model = build(PP2, cpu_attention=True)
    load_whole(model, init)
    wrapped, opt = fabric.setup(model, optimizer(model.parameters()))
    steps = batches(fabric)
    losses = train(fabric, wrapped, opt, steps[:HALF])
    fabric.save(out / "fabric_pp2.ckpt", {"model": wrapped, "optimizer": opt, "step": HALF})
    losses += train(fabric, wrapped, opt, steps[HALF:])
    full = {"losses": losses, "weights": whole_named(model), "stage": stage()}
    fresh = build(PP2, cpu_attention=True)
    fresh_model, fresh_opt = fabric.setup(fresh, optimizer(fresh.parameters()))
    state: dict[str, Any] = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
    fabric.load(out / "fabric_pp2.ckpt", state)
    resumed_losses = train(fabric, fresh_model, fresh_opt, steps[state["step"] :])
    resumed = {"losses": resumed_losses, "weights": whole_named(fresh), "stage": stage(), "step": state["step"]}
    strategy.teardown()
    return full, resumed


class PipelinedGPT(L.LightningModule):
    def __init__(self, init: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.init = init
        self.gpt: nn.Module | None = None
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = build(PP2, cpu_attention=True)
            load_whole(self.gpt, self.init)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        strategy = self.trainer.strategy
        assert isinstance(opt, L.pytorch.core.optimizer.LightningOptimizer) and self.gpt is not None
        assert isinstance(strategy, AcceleratedMegatronLMStrategy)
        loss = strategy.pipeline_step(self.gpt, batch, model_output, mean_loss)
        opt.step()
        opt.zero_grad()
        self.losses.append(float(loss))

    def on_train_end(self) -> None:
        assert self.gpt is not None
        self.result = {"losses": self.losses, "weights": whole_named(self.gpt), "stage": stage()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters())


def run_trainer_pp2(out: Path) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    module = PipelinedGPT(torch.load(out / "init.pt"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=AcceleratedMegatronLMStrategy(PP2),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    return module.result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world == 1:
        torch.save(run_reference(args.out), args.out / f"pp1_rank{rank}.pt")
        return
    full, resumed = run_fabric_pp2(args.out)
    torch.save(full, args.out / f"fabric_pp2_rank{rank}.pt")
    torch.save(resumed, args.out / f"fabric_pp2_resumed_rank{rank}.pt")
    dist.barrier()
    torch.save(run_trainer_pp2(args.out), args.out / f"trainer_pp2_rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
