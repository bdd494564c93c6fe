"""save_state / load_state under FSDP and DeepSpeed on 2 CPU processes: exact resume, Accelerate's files, one launch.

For each variant (DDP, FSDP2 and FSDP1 with sharded and full state dicts, DeepSpeed ZeRO-2 and ZeRO-3), run A trains 8
micro-batches per process (accumulation 2, AdamW, StepLR, seedable sampler), saves after 4 and ends with
``save_model``; run B, a fresh ``Accelerator`` with other initial weights, loads that checkpoint and trains the last 4.
Where HF accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` run on CPU, they also write the saved state, run
B loads it back through HF's ``load_fsdp_model`` first (HF reads ours) and then resumes from a copy of the checkpoint
whose model and optimizer files are HF's (we read HF's). Each rank writes ``{variant}_rank{r}.pt`` for
``tests/unit/checkpoint/test_accelerator_sharded_ckpt.py``, which also reads the folders under ``--out/{variant}``:
``checkpoint``,
``hf`` (HF's files), ``ours_with_hf_files`` and ``model`` (``save_model``).

A last phase checks Accelerate's DeepSpeed rules against DDP (``deepspeed_rules_rank{r}.pt``): with large gradients,
``DeepSpeedPlugin()``'s ``"auto"`` clipping is Accelerate's 1.0 (DDP clips with ``clip_grad_norm_(..., 1.0)``), also
with ``GradientAccumulationPlugin(sync_each_batch=True)``, and the engine's config is recorded. Where the run calls
``clip_grad_norm_`` at each sync step, the values it returns are recorded: under DeepSpeed, the engine's global norm
of the step it took in ``backward`` (Accelerate's behaviour), to compare with DDP's.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.state import reset_state
from lightning_accel.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
)

MICRO_BATCHES = 8
SAVE_AFTER = 4


def _fsdp(version: int, state_dict_type: str) -> dict[str, Any]:
    return {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)}


def _zero(stage: int, **fields: Any) -> dict[str, Any]:
    """ZeRO without clipping, as DDP here: only an explicit 0 in the config turns off DeepSpeed's default of 1.0."""
    plugin = DeepSpeedPlugin(zero_stage=stage, **fields)
    plugin.deepspeed_config["gradient_clipping"] = 0.0
    return {"deepspeed_plugin": plugin}


VARIANTS: dict[str, Any] = {
    "ddp": dict,  # the reference: every engine must train to its weights
    "fsdp2_sharded": lambda: _fsdp(2, "SHARDED_STATE_DICT"),
    "fsdp2_full": lambda: _fsdp(2, "FULL_STATE_DICT"),
    "fsdp1_sharded": lambda: _fsdp(1, "SHARDED_STATE_DICT"),
    "fsdp1_full": lambda: _fsdp(1, "FULL_STATE_DICT"),
    "zero2": lambda: _zero(2),
    "zero3": lambda: _zero(3, zero3_save_16bit_model=True),
}
# HF accelerate's FSDP1 full-state-dict functions gather with CPU offload, which crashes when training on CPU; its
# FSDP1 sharded optimizer loading fails on a fresh optimizer (on its own checkpoints too).
HF_RUNS_ON_CPU = {"fsdp2_sharded", "fsdp2_full", "fsdp1_sharded"}
HF_LOADS_OPTIMIZER = {"fsdp2_sharded", "fsdp2_full"}


def setup(variant: str, seed: int, **accelerator_kwargs: Any) -> tuple[Accelerator, Any, Any, Any, Any]:
    reset_state()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3),
        **VARIANTS[variant](),
        **accelerator_kwargs,
    )
    torch.manual_seed(seed)
    model: Any = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    if variant.startswith("fsdp"):  # FSDP shards first; the optimizer takes the sharded parameters
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * MICRO_BATCHES, 4, generator=g), torch.randn(4 * MICRO_BATCHES, 1, generator=g))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    if variant.startswith("fsdp"):
        optimizer, scheduler, loader = accelerator.prepare(optimizer, scheduler, loader)
    else:
        model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    return accelerator, model, optimizer, scheduler, loader


def train(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def weights(accelerator: Accelerator, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}


def hf_io(accelerator: Accelerator, variant: str) -> tuple[Any, Any, Any]:
    """HF accelerate's FSDP plugin for this variant and a stand-in for the accelerator its functions read."""
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin as HFPlugin
    from accelerate.utils import fsdp_utils

    PartialState(cpu=True)  # HF's logging needs it; it joins the process group that is already there
    ours = VARIANTS[variant]()["fsdp_plugin"]
    plugin = HFPlugin(fsdp_version=ours.fsdp_version, state_dict_type=ours.state_dict_type)
    stand_in = SimpleNamespace(
        num_processes=accelerator.num_processes,
        process_index=accelerator.process_index,
        is_main_process=accelerator.is_main_process,
        is_fsdp2=ours.fsdp_version == 2,
        wait_for_everyone=accelerator.wait_for_everyone,
    )
    return fsdp_utils, plugin, stand_in


def hf_save(accelerator: Accelerator, variant: str, model: Any, optimizer: Any, target: Path) -> None:
    fsdp_utils, plugin, stand_in = hf_io(accelerator, variant)
    module, raw = model._forward_module, optimizer.optimizer.optimizer
    fsdp_utils.save_fsdp_model(plugin, stand_in, module, str(target))
    fsdp_utils.save_fsdp_optimizer(plugin, stand_in, raw, module, str(target))
    accelerator.wait_for_everyone()


def hf_load(accelerator: Accelerator, variant: str, model: Any, optimizer: Any, source: Path) -> None:
    fsdp_utils, plugin, stand_in = hf_io(accelerator, variant)
    module, raw = model._forward_module, optimizer.optimizer.optimizer
    fsdp_utils.load_fsdp_model(plugin, stand_in, module, str(source))
    if variant in HF_LOADS_OPTIMIZER:
        fsdp_utils.load_fsdp_optimizer(plugin, stand_in, raw, module, str(source))


def model_files(checkpoint: Path) -> list[Path]:
    """What the engine wrote, and the manifest: everything but the files the shim writes for every run.

    The manifest goes with the engine's files, since a folder that mixes in HF's files is not what was saved.
    """
    common = ("scheduler", "random_states_")
    return [p for p in checkpoint.iterdir() if not p.name.startswith(common)]


def with_hf_model_files(accelerator: Accelerator, ours: Path, hf: Path, target: Path) -> None:
    """A copy of our checkpoint whose model and optimizer files are the ones HF accelerate wrote."""
    if accelerator.is_main_process:
        shutil.copytree(ours, target)
        for path in model_files(target):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in hf.iterdir():
            (shutil.copytree if path.is_dir() else shutil.copy)(path, target / path.name)
    accelerator.wait_for_everyone()


def run_a(variant: str, out: Path) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler, loader = setup(variant, seed=0)
    batches = iter(loader)
    train(accelerator, model, optimizer, scheduler, (next(batches) for _ in range(SAVE_AFTER)))
    saved = weights(accelerator, model)
    accelerator.save_state(out / variant / "checkpoint")
    if variant in HF_RUNS_ON_CPU:
        hf_save(accelerator, variant, model, optimizer, out / variant / "hf")
    train(accelerator, model, optimizer, scheduler, batches)
    accelerator.save_model(model, out / variant / "model")
    return {"saved": saved, "final": weights(accelerator, model), "lr": scheduler.get_last_lr()}


def run_b(variant: str, out: Path) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler, loader = setup(variant, seed=100)
    result: dict[str, Any] = {"initial": weights(accelerator, model)}
    source = out / variant / "checkpoint"
    if variant in HF_RUNS_ON_CPU:
        hf_load(accelerator, variant, model, optimizer, source)
        result["hf_loaded_ours"] = weights(accelerator, model)
        source = out / variant / "ours_with_hf_files"
        with_hf_model_files(accelerator, out / variant / "checkpoint", out / variant / "hf", source)
    accelerator.load_state(source, resume_position=True)  # the loop below does not skip the batches itself
    train(accelerator, model, optimizer, scheduler, loader)
    result.update({"final": weights(accelerator, model), "lr": scheduler.get_last_lr()})
    return result


RULES: dict[str, Any] = {  # ZeRO stage (None: DDP), sync_each_batch, call clip_grad_norm_ (DeepSpeed: the norm)
    "ddp_clip": (None, False, True),  # the reference
    "ddp_unclipped": (None, False, False),  # shows that clipping changes the weights
    "zero2": (2, False, True),
    "zero2_no_clip_call": (2, False, False),  # the engine clips whether or not the script asks for the norm
    "zero1_each_batch": (1, True, False),
    "zero2_each_batch": (2, True, True),
}


def rules_run(stage: int | None, each_batch: bool, clip: bool) -> dict[str, Any]:
    """8 micro-batches of large gradients, accumulation 2; DeepSpeed clips by its config, DDP by clip_grad_norm_."""
    reset_state()
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=each_batch),
        **({} if stage is None else {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=stage)}),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g) * 10, torch.randn(32, 1, generator=g) * 100)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    norms, skipped = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if clip and accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                norms.append(norm.item() if isinstance(norm, torch.Tensor) else norm)  # DeepSpeed: a float
            optimizer.step()
            skipped.append(accelerator.optimizer_step_was_skipped)
            optimizer.zero_grad()
    config = dict(accelerator.fabric.strategy.config) if stage is not None else None
    return {"final": weights(accelerator, model), "config": config, "norms": norms, "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    for variant in args.variants:
        result = {"a": run_a(variant, args.out), "b": run_b(variant, args.out)}
        rank = torch.distributed.get_rank()
        torch.save(result, args.out / f"{variant}_rank{rank}.pt")
    rules = {name: rules_run(*setting) for name, setting in RULES.items()}
    torch.save(rules, args.out / f"deepspeed_rules_rank{torch.distributed.get_rank()}.pt")
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
