"""Comet (``log_with="comet_ml"``), on the ``comet_ml`` package directly (``comet_ml.start``, 3.41 or newer).

Lightning's ``CometLogger`` is not used: it sends metrics through a private Comet call tagged as Lightning's and has
no place for text values, while Accelerate's tracker logs numbers with ``log_metric`` at the given step, strings with
``log_other`` and dicts with ``log_metrics``; this one does the same. ``comet_ml.start`` takes the rest from Comet's
configuration (API key, workspace; ``COMET_START_ONLINE=false`` and ``COMET_OFFLINE_DIRECTORY`` for offline runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from lightning_accel.tracking.base import GeneralTracker, import_tracker_package, on_main_process

__all__ = ["COMET_INSTALL", "CometMLTracker"]

COMET_INSTALL = "pip install comet_ml"


class CometMLTracker(GeneralTracker):
    """A Comet experiment: ``comet_ml.start(project_name=run_name, **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers`` (Comet's ``project_name``).
        **kwargs: Passed to ``comet_ml.start`` (``init_kwargs={"comet_ml": {...}}``): ``online``, ``mode``,
            ``experiment_config``, ...

    """

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @override
    @on_main_process
    def start(self) -> None:
        comet_ml = import_tracker_package("comet_ml", COMET_INSTALL)
        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    @property
    @override
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.writer

    @override
    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.writer.log_parameters(dict(values))

    @override
    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers (and one-element tensors) as metrics, strings as "other" values, dicts of numbers as metrics.

        Raises:
            TypeError: For values of another type.

        """
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                raise TypeError(f"Comet cannot log {key}={type(value).__name__}; log numbers, strings or dicts.")

    @override
    @on_main_process
    def finish(self) -> None:
        self.writer.end()
