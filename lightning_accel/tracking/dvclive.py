"""DVCLive (``log_with="dvclive"``), on the ``dvclive`` package's ``Live``.

As in Accelerate: ``init_trackers``' project name is not used (DVCLive has none; ``init_kwargs["dvclive"]["dir"]``
says where it writes), a ``Live`` passed as ``live`` is used as it is, the configuration goes to ``log_params``
(``params.yaml``), and each ``log`` call is one DVCLive step: the given step, if any, then ``next_step()``.
Everything is local files (``metrics.json``, ``plots/metrics/<key>.tsv``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _RunAlias, _RunTracker, as_python_scalar

__all__ = ["DVCLIVE_INSTALL", "DVCLiveTracker"]

DVCLIVE_INSTALL = "pip install dvclive"


class DVCLiveTracker(_RunTracker):
    """A ``dvclive.Live``: ``live`` if given, else ``Live(**kwargs)``.

    Args:
        run_name: Not used (Accelerate's signature; DVCLive has no project name).
        live: A ``dvclive.Live`` to log to instead of making one.
        **kwargs: Passed to ``dvclive.Live`` (``init_kwargs={"dvclive": {...}}``): ``dir``, ``save_dvc_exp``, ...

    """

    name = "dvclive"
    _package_name = "dvclive"
    _install = DVCLIVE_INSTALL
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs: Any) -> None:
        super().__init__(None, **kwargs)
        del run_name
        self.run = live

    live = _RunAlias("The ``dvclive.Live`` (Accelerate's attribute name).")

    @override
    def _open_run(self) -> Any:
        if self.run is not None:
            return self.run
        return self._package().Live(**self.init_kwargs)

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Write ``values`` with ``Live.log_params`` (``params.yaml``)."""
        self.run.log_params(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Log the values DVCLive takes as metrics at ``step`` (else the current step), then advance one step.

        Values DVCLive cannot log as a metric are dropped with a warning, as Accelerate drops them.
        """
        from dvclive.plots import Metric

        if step is not None:
            self.run.step = step
        for key, raw in values.items():
            value = as_python_scalar(raw)
            if Metric.could_log(value):
                self.run.log_metric(key, value, **kwargs)
            else:
                warnings.warn(f"DVCLive cannot log {key}={type(raw).__name__} as a metric: dropped.", stacklevel=4)
        self.run.next_step()

    @override
    def _close_run(self) -> None:
        self.run.end()
