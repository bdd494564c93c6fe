"""A Trainer script for ``lightning-accel launch`` with a MEGATRON_LM config: ``L.Trainer(**trainer_kwargs())``.

Each rank trains ``megatron_parity.py``'s model and data for 4 steps and saves ``launched_rank{r}.pt`` (losses, full
weights, the parallel state it saw), to compare with ``megatron_parity.py``'s 1-process ``tp1`` run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_accel.strategies.from_settings import trainer_kwargs
from tests.scripts.megatron_parity import GLOBAL_BATCH, STEPS, GPTModule, dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kwargs = trainer_kwargs()
    plugin = kwargs["strategy"].megatron_lm_plugin
    module = GPTModule(plugin, cpu_attention=True)
    trainer = L.Trainer(
        **kwargs,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dp = trainer.world_size // plugin.tp_degree
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp))
    torch.save({"losses": module.losses, **module.result}, args.out / f"launched_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
