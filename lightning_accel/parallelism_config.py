"""Accelerate's ``accelerate.parallelism_config`` path: :class:`ParallelismConfig` (defined in the config layer)."""

from lightning_accel.config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
