"""Comet (``log_with="comet_ml"``), on the ``comet_ml`` package directly (``comet_ml.start``, 3.41 or newer).

Lightning's ``CometLogger`` is not used: it sends metrics through a private Comet call tagged as Lightning's and has
no place for text values, while Accelerate's tracker logs numbers with ``log_metric`` at the given step, strings with
``log_other`` and dicts with ``log_metrics``; this one does the same. ``comet_ml.start`` takes the rest from Comet's
configuration (API key, workspace; ``COMET_START_ONLINE=false`` and ``COMET_OFFLINE_DIRECTORY`` for offline runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import KindWriters, _RunAlias, _RunTracker, log_by_kind

__all__ = ["COMET_INSTALL", "CometMLTracker"]

COMET_INSTALL = "pip install comet_ml"


class CometMLTracker(_RunTracker):
    """A Comet experiment: ``comet_ml.start(project_name=run_name, **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers`` (Comet's ``project_name``).
        **kwargs: Passed to ``comet_ml.start`` (``init_kwargs={"comet_ml": {...}}``): ``online``, ``mode``,
            ``experiment_config``, ...

    """

    name = "comet_ml"
    _package_name = "comet_ml"
    _install = COMET_INSTALL
    requires_logging_directory = False

    writer = _RunAlias("The Comet experiment (Accelerate's attribute name).")

    @override
    def _open_run(self) -> Any:
        return self._package().start(project_name=self.run_name, **self.init_kwargs)

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        self.run.log_parameters(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Numbers (and one-element tensors) as metrics, strings as "other" values, dicts of numbers as metrics."""
        if step is not None:
            self.run.set_step(step)
        writers = KindWriters(
            number=lambda key, value: self.run.log_metric(key, value, step=step, **kwargs),
            text=lambda key, value: self.run.log_other(key, value, **kwargs),
            group=lambda _, value: self.run.log_metrics(value, step=step, **kwargs),
        )
        log_by_kind("Comet", values, writers)

    @override
    def _close_run(self) -> None:
        self.run.end()
