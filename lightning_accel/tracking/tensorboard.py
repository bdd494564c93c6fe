"""TensorBoard through Lightning's ``TensorBoardLogger``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from lightning_accel.tracking.base import GeneralTracker, on_main_process

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(GeneralTracker):
    """TensorBoard through Lightning's ``TensorBoardLogger``, writing to ``<logging_dir>/<run_name>`` as Accelerate.

    Args:
        run_name: The project name given to ``init_trackers``.
        logging_dir: The accelerator's logging directory.
        **kwargs: Passed to ``SummaryWriter``.

    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir
        self._kwargs = kwargs
        self._logger: Any = None

    @override
    @on_main_process
    def start(self) -> None:
        from lightning.fabric.loggers import TensorBoardLogger

        self._logger = TensorBoardLogger(self.logging_dir, name=self.run_name, version="", **self._kwargs)

    @property
    @override
    def tracker(self) -> Any:
        return self._logger.experiment

    @override
    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self._logger.log_hyperparams(dict(values))

    @override
    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Scalars (numbers, 0-d tensors) as scalars, strings as text, dicts of numbers as grouped scalars.

        Raises:
            TypeError: For values of another type.

        """
        for key, value in values.items():
            if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.ndim == 0):
                self._logger.log_metrics({key: float(value)}, step=step)
            elif isinstance(value, str):
                self.tracker.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.tracker.add_scalars(key, value, global_step=step, **kwargs)
            else:
                raise TypeError(f"TensorBoard cannot log {key}={type(value).__name__}; log numbers, strings or dicts.")
        self.tracker.flush()

    @override
    @on_main_process
    def finish(self) -> None:
        self._logger.finalize("success")
