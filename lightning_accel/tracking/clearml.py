"""ClearML (``log_with="clearml"``), on the ``clearml`` package's ``Task``.

As in Accelerate: a task already started in the process (``Task.current_task()``) is reused and left open at the
end; otherwise ``Task.init`` opens one whose project and name are ``init_trackers``' ``project_name`` unless
``CLEARML_PROJECT`` / ``CLEARML_TASK`` say otherwise. The configuration is connected with ``connect_configuration``.
Values logged at a step are scalars titled by their key with the series ``train`` (``eval_``/``test_``/``train_``
prefixes pick the series and are cut off); without a step they are single values. Offline, with no server:
``CLEARML_OFFLINE_MODE=1`` (or ``Task.set_offline(True)``) writes the session under ``CLEARML_CACHE_DIR``.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import (
    _RunAlias,
    _Table,
    _TableTracker,
    as_python_scalar,
    on_main_process,
)

__all__ = ["CLEARML_INSTALL", "ClearMLTracker"]

CLEARML_INSTALL = "pip install clearml"

_SERIES = ("eval", "test", "train")


def title_and_series(name: str) -> tuple[str, str]:
    """ClearML's title and series for a key: ``"eval_loss"`` -> ``("loss", "eval")``, else ``(name, "train")``."""
    for series in _SERIES:
        if name.startswith(series + "_"):
            return name[len(series) + 1 :], series
    return name, "train"


class ClearMLTracker(_TableTracker):
    """A ClearML task: the process's current one, or ``Task.init(project_name=..., task_name=..., **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers``: ClearML's project and task name unless
            ``CLEARML_PROJECT`` / ``CLEARML_TASK`` are set.
        **kwargs: Passed to ``Task.init`` (``init_kwargs={"clearml": {...}}``); their ``project_name`` and
            ``task_name`` win over the above.

    """

    name = "clearml"
    _package_name = "clearml"
    _install = CLEARML_INSTALL
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.user_provided_run_name = run_name
        self._initialized_externally = False

    task = _RunAlias("The ``clearml.Task`` (Accelerate's attribute name).")

    @override
    def _open_run(self) -> Any:
        task_class = self._package().Task
        current = task_class.current_task()
        if current is not None:
            self._initialized_externally = True
            return current
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.run_name))
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK", self.run_name))
        return task_class.init(**kwargs)

    @override
    def _store_config(self, values: dict[str, Any]) -> Any:
        """Connect ``values`` as the task's configuration; returns what ClearML returns (the connected values)."""
        return self.run.connect_configuration(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Numbers (and one-element tensors) as scalars at ``step``, or as single values without one.

        Other values are dropped with a warning, as Accelerate drops them (ClearML's scalars are numbers only).
        """
        clearml_logger = self.run.get_logger()
        for key, raw in values.items():
            value = as_python_scalar(raw)
            if not isinstance(value, numbers.Real):
                warnings.warn(f"ClearML logs numbers only: {key}={type(raw).__name__} is dropped.", stacklevel=4)
                continue
            if step is None:
                clearml_logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = title_and_series(key)
                clearml_logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report each value (a numpy array or PIL image) with ``Logger.report_image`` at ``step``."""
        clearml_logger = self.run.get_logger()
        for key, image in values.items():
            title, series = title_and_series(key)
            clearml_logger.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @override
    def _log_table(self, table_name: str, table: _Table, step: int | None, kwargs: dict[str, Any]) -> None:
        """Report a table from ``dataframe``, or from ``data`` with ``columns`` as its header.

        Without ``columns``, the first row of ``data`` is the header.

        Raises:
            ValueError: If neither ``dataframe`` nor ``data`` is given.

        """
        plot = table.dataframe
        if plot is None:
            if table.data is None:
                raise ValueError(f"ClearMLTracker.log_table({table_name!r}) needs `data` (rows) or a `dataframe`.")
            plot = [table.columns, *table.data] if table.columns else table.data
        title, series = title_and_series(table_name)
        self.run.get_logger().report_table(title=title, series=series, table_plot=plot, iteration=step, **kwargs)

    @override
    def _close_run(self) -> None:
        """Close the task, unless it was started outside this tracker."""
        if self.run is not None and not self._initialized_externally:
            self.run.close()
