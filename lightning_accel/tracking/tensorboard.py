"""TensorBoard through Lightning's ``TensorBoardLogger``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from lightning_accel.tracking.base import KindWriters, _RunTracker, log_by_kind

__all__ = ["TensorBoardTracker"]


def _zero_dim_as_number(value: Any) -> Any:
    """A 0-d tensor as its Python number (the tensors TensorBoard logs as scalars); any other value unchanged."""
    return value.item() if isinstance(value, torch.Tensor) and value.ndim == 0 else value


class TensorBoardTracker(_RunTracker):
    """TensorBoard through Lightning's ``TensorBoardLogger``, writing to ``<logging_dir>/<run_name>`` as Accelerate.

    Args:
        run_name: The project name given to ``init_trackers``.
        logging_dir: The accelerator's logging directory.
        **kwargs: Passed to ``SummaryWriter``.

    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = logging_dir

    @override
    def _open_run(self) -> Any:
        from lightning.fabric.loggers import TensorBoardLogger

        return TensorBoardLogger(self.logging_dir, name=self.run_name, version="", **self.init_kwargs)

    @property
    @override
    def tracker(self) -> Any:
        """The ``SummaryWriter`` of the run's ``TensorBoardLogger``."""
        return self.run.experiment

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        self.run.log_hyperparams(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Scalars (numbers, 0-d tensors) as scalars, strings as text, dicts of numbers as grouped scalars."""
        writers = KindWriters(
            number=lambda key, value: self.run.log_metrics({key: float(value)}, step=step),
            text=lambda key, value: self.tracker.add_text(key, value, global_step=step, **kwargs),
            group=lambda key, value: self.tracker.add_scalars(key, value, global_step=step, **kwargs),
        )
        log_by_kind("TensorBoard", values, writers, scalar=_zero_dim_as_number)
        self.tracker.flush()

    @override
    def _close_run(self) -> None:
        self.run.finalize("success")
