"""Sequence parallelism inside a pipeline: tp_degree=2, pp_degree=2, 4 CPU processes (gloo), through Fabric.

Run under ``torch.distributed.run`` with 4 processes after ``megatron_pipeline.py`` wrote ``init.pt`` (the whole
model's initial weights) and its ``pp1`` reference into ``--out``. Each rank loads its stage's tensor-parallel slices
of ``init.pt``, trains on the reference's batches with ``strategy.pipeline_step`` (megatron's 1F1B schedule over 2
micro-batches, sequence-parallel activations between the stages) and saves ``tp2_pp2_sp_rank{r}.pt``: the reported
losses, the stage and its weights made whole, under the whole model's names.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_accel  # noqa: F401  (registers the strategy names)
from lightning_accel.checkpoint.megatron import global_layer_names, split_model_state
from lightning_accel.strategies.megatron import FabricAcceleratedMegatronLMStrategy
from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import COMMON, build, full_weights, optimizer
from tests.scripts.megatron_pipeline import batches, mean_loss, model_output, stage

TP2_PP2_SP = MegatronLMPlugin(
    **COMMON, tp_degree=2, pp_degree=2, num_micro_batches=2, sequence_parallelism=True, gradient_clipping=0
)


def run(out: Path) -> dict[str, Any]:
    strategy = FabricAcceleratedMegatronLMStrategy(TP2_PP2_SP)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = build(TP2_PP2_SP, cpu_attention=True)
    init, names = torch.load(out / "init.pt"), global_layer_names(model)
    stage_state = {key: init[names[key]] for key in model.state_dict() if names[key] in init}
    model.load_state_dict(split_model_state(stage_state, model), strict=False)
    wrapped, opt = fabric.setup(model, optimizer(model.parameters()))
    losses = []
    for batch in batches(fabric):
        loss = strategy.pipeline_step(wrapped, batch, model_output, mean_loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    result = {
        "losses": losses,
        "weights": {names[key]: value for key, value in full_weights(model).items()},
        "stage": stage(),
    }
    strategy.teardown()  # megatron's parallel state goes with it
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert int(os.environ["WORLD_SIZE"]) == 4
    torch.save(run(args.out), args.out / f"tp2_pp2_sp_rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
