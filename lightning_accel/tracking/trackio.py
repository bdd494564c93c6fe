"""Trackio (``log_with="trackio"``), on the ``trackio`` package (``trackio.init`` and its ``Run``).

As in Accelerate: the project is ``init_trackers``' ``project_name`` and ``log`` is ``Run.log(values, step=step)``.
Trackio writes each project to a local SQLite database (under ``TRACKIO_DIR``) unless ``space_id``/``server_url``
point it at a server. The configuration is merged into the run's config before its first ``log``; Accelerate calls
``trackio.config.update(values, allow_val_change=True)``, and as Trackio's config is a plain dict that also stores
an ``allow_val_change`` entry, which this tracker does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _RunTracker, as_python_scalar

__all__ = ["TRACKIO_INSTALL", "TrackioTracker"]

TRACKIO_INSTALL = "pip install trackio"


class TrackioTracker(_RunTracker):
    """A Trackio run: ``trackio.init(project=run_name, **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers`` (Trackio's ``project``).
        **kwargs: Passed to ``trackio.init`` (``init_kwargs={"trackio": {...}}``): ``name``, ``group``,
            ``space_id``, ``auto_log_cpu``...

    """

    name = "trackio"
    _package_name = "trackio"
    _install = TRACKIO_INSTALL
    requires_logging_directory = False
    main_process_only = False

    @override
    def _open_run(self) -> Any:
        return self._package().init(project=self.run_name, **self.init_kwargs)

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Merge ``values`` into the run's config (recorded with the run's first ``log``)."""
        self.run.config.update(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """``Run.log(values, step=step, **kwargs)`` (one-element tensors as numbers)."""
        self.run.log({key: as_python_scalar(value) for key, value in values.items()}, step=step, **kwargs)
