"""An Accelerate-style Megatron loop on the ``Accelerator`` shim at pp_degree=2 (2 CPU processes, gloo).

Run under ``torch.distributed.run`` (or ``lightning-accel launch`` with a MEGATRON_LM config file) after
``megatron_pipeline.py`` wrote ``init.pt`` (the whole model's initial weights) and its ``pp1`` reference into
``--out``. The loop is the one Accelerate's Megatron integration expects: ``loss = model(**batch)`` runs the whole
training step, ``accelerator.backward(loss)``, ``optimizer.step()``, ``scheduler.step()`` and
``optimizer.zero_grad()`` do nothing. The batches are the reference's (the same shuffled order, one epoch).

``--phase full`` trains every step from ``init.pt``, calls ``save_state`` after half of them (``acc_state``) and
saves ``accelerator_pp2_rank{r}.pt``; ``--phase resume`` is a fresh launch that builds the model from its own seed,
``load_state``s ``acc_state``, skips the batches already trained and saves ``accelerator_pp2_resumed_rank{r}.pt``.
Each result holds the reported losses, the stage's weights under the whole model's names, the scheduler's step
count, an evaluation loss (``model.eval()``) and the stage.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_accel import Accelerator
from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import GLOBAL_BATCH, STEPS, build, dataset, optimizer
from tests.scripts.megatron_pipeline import HALF, PP2, load_whole, stage, whole_named


def reference_order_loader() -> DataLoader:
    """The reference's batches: its DistributedSampler's order at one data-parallel rank (shuffle, seed 0)."""
    order = list(DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0))
    return DataLoader(Subset(dataset(), order), batch_size=GLOBAL_BATCH)


def as_batch(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids, labels = batch
    return {"input_ids": ids, "labels": labels}


def train(accelerator: Accelerator, parts: tuple[Any, ...], loader: Any, steps: range, save: Path | None) -> list:
    model, opt, scheduler = parts
    losses = []
    for step, batch in enumerate(loader):
        if step not in steps:
            continue
        loss = model(**as_batch(batch))  # the whole step: forward and backward of the micro-batches, optimizer
        accelerator.backward(loss)  # nothing to do, as in Accelerate's Megatron integration
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(float(loss))
        if save is not None and step + 1 == HALF:
            accelerator.save_state(save)
    return losses


def run(out: Path, phase: str, plugin: MegatronLMPlugin | None) -> dict[str, Any]:
    accelerator = Accelerator(cpu=True, megatron_lm_plugin=plugin)
    given = accelerator.state.megatron_lm_plugin
    assert given is not None and (given.pp_degree, given.num_micro_batches) == (PP2.pp_degree, PP2.num_micro_batches)
    model = build(PP2, cpu_attention=True)
    if phase == "full":
        load_whole(model, torch.load(out / "init.pt"))
    opt = optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # stepped by the engine, changing nothing
    prepared = accelerator.prepare(model, opt, scheduler, reference_order_loader())
    loader = prepared[-1]
    if phase == "full":
        losses = train(accelerator, prepared[:3], loader, range(STEPS), out / "acc_state")
    else:
        accelerator.load_state(out / "acc_state")
        losses = train(accelerator, prepared[:3], loader, range(HALF, STEPS), None)
    engine = prepared[0]
    assert accelerator.unwrap_model(engine) is model
    with pytest.raises(ValueError, match=r"each pipeline stage holds part of the model"):
        accelerator.get_state_dict(engine)
    engine.eval()
    evaluated = float(engine(*next(iter(loader))))
    result = {
        "losses": losses,
        "weights": whole_named(model),
        "stage": stage(),
        "scheduler_steps": prepared[2].scheduler.last_epoch,
        "eval_loss": evaluated,
    }
    accelerator.wait_for_everyone()
    accelerator.fabric.strategy.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("full", "resume"), required=True)
    parser.add_argument("--plugin-from-config", action="store_true", help="the launch's config file gives the plugin")
    args = parser.parse_args()
    result = run(args.out, args.phase, None if args.plugin_from_config else PP2)
    name = "accelerator_pp2" if args.phase == "full" else "accelerator_pp2_resumed"
    torch.save(result, args.out / f"{name}_rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
