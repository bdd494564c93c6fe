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

from lightning_accel.tracking.base import GeneralTracker, as_python_scalar, import_tracker_package, on_main_process

__all__ = ["DVCLIVE_INSTALL", "DVCLiveTracker"]

DVCLIVE_INSTALL = "pip install dvclive"


class DVCLiveTracker(GeneralTracker):
    """A ``dvclive.Live``: ``live`` if given, else ``Live(**kwargs)``.

    Args:
        run_name: Not used (Accelerate's signature; DVCLive has no project name).
        live: A ``dvclive.Live`` to log to instead of making one.
        **kwargs: Passed to ``dvclive.Live`` (``init_kwargs={"dvclive": {...}}``): ``dir``, ``save_dvc_exp``, ...

    """

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs: Any) -> None:
        del run_name
        self.live: Any = live
        self.init_kwargs = kwargs

    @override
    @on_main_process
    def start(self) -> None:
        if self.live is None:
            self.live = import_tracker_package("dvclive", DVCLIVE_INSTALL).Live(**self.init_kwargs)

    @property
    @override
    def tracker(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live

    @override
    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Write ``values`` with ``Live.log_params`` (``params.yaml``)."""
        self.live.log_params(dict(values))

    @override
    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the values DVCLive takes as metrics at ``step`` (else the current step), then advance one step.

        Values DVCLive cannot log as a metric are dropped with a warning, as Accelerate drops them.
        """
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, raw in values.items():
            value = as_python_scalar(raw)
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                warnings.warn(f"DVCLive cannot log {key}={type(raw).__name__} as a metric: dropped.", stacklevel=3)
        self.live.next_step()

    @override
    @on_main_process
    def finish(self) -> None:
        self.live.end()
