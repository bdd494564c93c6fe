"""Mirror of ``accelerate.utils.deepspeed``: placeholders for the optimizer and scheduler of a DeepSpeed config."""

from lightning_accel._dummies import DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler

__all__ = ["DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler"]
