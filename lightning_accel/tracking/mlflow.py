"""MLflow (``log_with="mlflow"``), on mlflow's fluent API (``mlflow.start_run``/``log_metrics``/``end_run``).

Lightning's ``MLFlowLogger`` is not used: it logs through an ``MlflowClient`` without an active run (so
``mlflow.log_artifact`` and friends would not reach it), has no nested runs or description, renames metric keys
and logs ``step=None`` as 0 under its own experiment default. Accelerate's tracker starts an active run in the
experiment called ``project_name`` (``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` and
``MLFLOW_NESTED_RUN`` win over the arguments); this one does the same. Where runs are stored is mlflow's own
setting (``MLFLOW_TRACKING_URI``); ``logging_dir`` is the experiment's artifact location.
"""

from __future__ import annotations

import json
import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _RunTracker, as_python_scalar, import_tracker_package, on_main_process

__all__ = ["MLFLOW_INSTALL", "MLflowTracker"]

MLFLOW_INSTALL = "pip install mlflow  (or the lighter mlflow-skinny)"

_TRUE = {"1", "true", "yes", "y", "on", "t"}
_FALSE = {"0", "false", "no", "n", "off", "f"}


def _env_flag(name: str, default: bool) -> bool:
    text = os.environ.get(name)
    if text is None:
        return default
    if text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    raise ValueError(f"{name}={text!r} is not a boolean; use true or false.")


def _env_tags(tags: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    tags = os.environ.get("MLFLOW_TAGS", tags)
    return json.loads(tags) if isinstance(tags, str) else (dict(tags) if tags is not None else None)


def _as_number(value: Any) -> float | None:
    value = as_python_scalar(value)
    return float(value) if isinstance(value, numbers.Real) else None


class MLflowTracker(_RunTracker):
    """An active MLflow run in the experiment ``experiment_name`` (created when missing).

    Args:
        experiment_name: The experiment (``init_trackers``' ``project_name``); ``MLFLOW_EXPERIMENT_NAME`` wins.
        logging_dir: Artifact location of a new experiment.
        run_id: Resume this run instead of starting one; ``MLFLOW_RUN_ID`` wins.
        tags: Tags of the experiment and the run (a dict or its JSON); ``MLFLOW_TAGS`` wins.
        nested_run: Start the run inside the active one; ``MLFLOW_NESTED_RUN`` wins.
        run_name: The new run's name.
        description: The run's description.

    """

    name = "mlflow"
    _package_name = "mlflow"
    _install = MLFLOW_INSTALL
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__(run_name)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = _env_tags(tags)
        self.nested_run = _env_flag("MLFLOW_NESTED_RUN", nested_run)
        self.description = description

    @property
    def active_run(self) -> Any:
        """The ``mlflow.ActiveRun`` (Accelerate's attribute name)."""
        return self.run

    def _experiment_id(self, mlflow: Any) -> str | None:
        if self.experiment_name is None:
            return None
        found = mlflow.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return str(found.experiment_id)
        return str(
            mlflow.create_experiment(name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags)
        )

    @override
    def _open_run(self) -> Any:
        mlflow = self._package()
        return mlflow.start_run(
            run_id=self.run_id,
            experiment_id=self._experiment_id(mlflow),
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Log ``values`` as run parameters, in batches of mlflow's limit; values too long for mlflow are dropped."""
        mlflow = self._package()
        limits = import_tracker_package("mlflow.utils.validation", MLFLOW_INSTALL)
        params = {}
        for key, value in values.items():
            if len(str(value)) > limits.MAX_PARAM_VAL_LENGTH:
                warnings.warn(
                    f"MLflow keeps parameters up to {limits.MAX_PARAM_VAL_LENGTH} characters; {key!r} is dropped.",
                    stacklevel=4,
                )
            else:
                params[key] = value
        items = list(params.items())
        for start in range(0, len(items), limits.MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + limits.MAX_PARAMS_TAGS_PER_BATCH]))

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Log the numbers of ``values`` (ints, floats, one-element tensors) as metrics; other values are dropped."""
        metrics = {}
        for key, value in values.items():
            number = _as_number(value)
            if number is None:
                warnings.warn(
                    f"MLflow logs numbers only; {key}={type(value).__name__} is dropped.", UserWarning, stacklevel=4
                )
            else:
                metrics[key] = number
        self._package().log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """``mlflow.log_figure`` into the run (matplotlib or plotly figure)."""
        self._package().log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Copy the files of ``local_dir`` into the run's artifacts (under ``artifact_path``)."""
        self._package().log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Copy the file ``local_path`` into the run's artifacts (under ``artifact_path``)."""
        self._package().log_artifact(local_path=local_path, artifact_path=artifact_path)

    @override
    def _close_run(self) -> None:
        self._package().end_run()
