"""Callbacks that bring Accelerate's training-loop features to any Lightning strategy.

- :class:`GradientAccumulation`: Accelerate's accumulation windows (carry-over, true window size, sync each batch).
- :class:`SeedableSampler`: Accelerate's seedable shuffling, sharded across processes, resumable mid-epoch.
- :class:`CheckpointRotation`: ``checkpoint_{iteration}`` names, rotation, atomic saves, RNG states for exact resume.

They compose with each other and with Lightning's own callbacks::

    trainer = L.Trainer(
        strategy="acc_multi_cpu",
        devices=2,
        callbacks=[
            GradientAccumulation(num_steps=4),
            SeedableSampler(data_seed=42),
            CheckpointRotation(
                ProjectConfiguration("runs/exp1", automatic_checkpoint_naming=True, total_limit=3),
                every_n_train_steps=100,
            ),
        ],
    )
    trainer.fit(model, train_loader, ckpt_path="last")
"""

from lightning_accel.callbacks.checkpoint_rotation import CheckpointRotation, complete_checkpoints, latest_checkpoint
from lightning_accel.callbacks.gradient_accumulation import GradientAccumulation, MicroBatch, plan_micro_batch
from lightning_accel.callbacks.seedable_sampler import (
    SeedableSampler,
    ShardedSeedableSampler,
    epoch_order,
    shard_batches,
)

__all__ = [
    "CheckpointRotation",
    "GradientAccumulation",
    "MicroBatch",
    "SeedableSampler",
    "ShardedSeedableSampler",
    "complete_checkpoints",
    "epoch_order",
    "latest_checkpoint",
    "plan_micro_batch",
    "shard_batches",
]
