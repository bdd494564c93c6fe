"""A Trainer script for ``lightning-accel launch`` with a ``parallelism_config``: ``L.Trainer(**trainer_kwargs())``.

The launcher hands the config file's sizes to the processes as ``ACCELERATE_USE_PARALLELISM_CONFIG`` and
``PARALLELISM_CONFIG_*``; ``trainer_kwargs()`` turns them into ``acc_parallel``. The model is
``tests/scripts/parallel_parity.py``'s MLP, tensor-parallel from ``configure_model`` on ``self.device_mesh["tp"]``.
Each rank writes ``launch_rank{r}.pt``: the data-parallel mean of its losses, the full weights, what the strategy
reported and the single-process reference run of the same model and data.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_accel import trainer_kwargs
from tests.scripts.parallel_parity import (
    BATCH,
    Regressor,
    dataset,
    describe,
    full_weights,
    mean_over_processes,
    reference,
)

EPOCHS = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kwargs = trainer_kwargs()
    module = Regressor(apply_plan=True)
    trainer = L.Trainer(
        **kwargs,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    strategy = trainer.strategy
    config = strategy._parallel.config  # type: ignore[attr-defined]
    dp_size = config.dp_replicate_size * config.dp_shard_size
    result = {
        "losses": mean_over_processes(module.losses),
        "weights": full_weights(strategy, strategy.model, prefix="net."),  # type: ignore[arg-type]
        "trainer_kwargs": {key: value for key, value in kwargs.items() if key != "strategy"},
        "sizes": (config.dp_replicate_size, config.dp_shard_size, config.cp_size, config.tp_size),
        "variables": {name: value for name, value in os.environ.items() if "PARALLELISM" in name},
        "reference": reference(dp_size, epochs=EPOCHS, shuffle=True),
        **describe(strategy, module),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"launch_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
