"""The ``Accelerator``'s ``save_state`` / ``load_state`` at tp_degree=2 (2 CPU processes, gloo): whole tensors.

Run under ``torch.distributed.run`` with 2 processes. The shim trains ``megatron_parity.py``'s model for 2 steps
with the plain loop (at pp_degree=1 the prepared model is the user's forward), saves its state into ``tp2_state``,
takes ``get_state_dict`` (the whole weights), overwrites the weights and the momentum and loads the folder back.
Each rank saves ``accelerator_tp2_state_rank{r}.pt``: whether every local shard and momentum buffer came back bit
for bit, the whole weights ``get_state_dict`` gave, and this rank's shards before the reload.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_accel import Accelerator
from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import COMMON, GLOBAL_BATCH, build, dataset, loss_of, optimizer

TP2 = MegatronLMPlugin(**COMMON, tp_degree=2, gradient_clipping=0)


def snapshot(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    shards = {name: param.detach().clone() for name, param in model.named_parameters()}
    for index, state in opt.state_dict()["state"].items():
        shards[f"momentum.{index}"] = state["momentum_buffer"].clone()
    return shards


def run(out: Path) -> dict[str, Any]:
    accelerator = Accelerator(cpu=True, megatron_lm_plugin=TP2)
    strategy = accelerator.fabric.strategy
    model = build(TP2, cpu_attention=True)
    prepared, opt = accelerator.prepare(model, optimizer(model.parameters()))
    sampler = DistributedSampler(dataset(), shuffle=False, **strategy.distributed_sampler_kwargs)
    for step, batch in enumerate(DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler)):
        if step == 2:
            break
        accelerator.backward(loss_of(prepared, batch))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(out / "tp2_state")
    whole = accelerator.get_state_dict(prepared)
    before = snapshot(model, opt)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    for state in opt.state.values():
        state["momentum_buffer"].zero_()
    accelerator.load_state(out / "tp2_state")
    after = snapshot(model, opt)
    restored = {name: torch.equal(after[name], value) for name, value in before.items()}
    result = {"restored": restored, "whole": {k: v for k, v in whole.items() if torch.is_tensor(v)}, "shards": before}
    accelerator.wait_for_everyone()
    strategy.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.save(run(args.out), args.out / f"accelerator_tp2_state_rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
