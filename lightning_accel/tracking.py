"""Experiment trackers for the ``Accelerator`` (``log_with``, ``init_trackers``, ``log``, ``get_tracker``).

``"tensorboard"`` is backed by Lightning's ``TensorBoardLogger``; any :class:`GeneralTracker` subclass can be passed
as is. Other Accelerate tracker names are refused with an error until they are implemented.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_accel.enums import LoggerType
from lightning_accel.state import PartialState

__all__ = ["GeneralTracker", "TensorBoardTracker", "TrackingMixin", "resolve_trackers"]


class GeneralTracker:
    """Base of every tracker: override ``start``, ``store_init_configuration``, ``log``, ``finish`` and ``tracker``.

    Attributes:
        name: How ``init_kwargs``/``log_kwargs`` and ``get_tracker`` refer to it.
        requires_logging_directory: Whether the ``Accelerator`` passes its ``logging_dir`` to the constructor.
        main_process_only: Whether only the main process logs.

    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def start(self) -> None:
        """Open the run (called by ``init_trackers``)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (e.g. a ``SummaryWriter``)."""
        return None

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Close the run."""


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
    def start(self) -> None:
        from lightning.fabric.loggers import TensorBoardLogger

        self._logger = TensorBoardLogger(self.logging_dir, name=self.run_name, version="", **self._kwargs)

    @property
    @override
    def tracker(self) -> Any:
        return self._logger.experiment

    @override
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self._logger.log_hyperparams(dict(values))

    @override
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
    def finish(self) -> None:
        self._logger.finalize("success")


_BUILT_IN: dict[str, type[GeneralTracker]] = {"tensorboard": TensorBoardTracker}


def _available(name: str) -> bool:
    return name == "tensorboard" and (
        importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None
    )


def resolve_trackers(log_with: Any) -> list[str | GeneralTracker]:
    """Normalise ``log_with`` to tracker names and tracker objects.

    Raises:
        ValueError: For an unknown name, a known one not implemented yet, or ``"tensorboard"`` when not installed.

    """
    items = log_with if isinstance(log_with, Sequence) and not isinstance(log_with, str) else [log_with]
    resolved: list[str | GeneralTracker] = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, GeneralTracker):
            resolved.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        if name not in LoggerType:
            raise ValueError(f"Unknown tracker {item!r}; use one of {LoggerType.list()} or a GeneralTracker.")
        if name == "all":
            resolved.extend(n for n in _BUILT_IN if _available(n))
        elif name not in _BUILT_IN:
            raise ValueError(
                f"Tracker {name!r} is not supported by lightning_accel yet; use 'tensorboard' or pass a GeneralTracker"
                " subclass instance."
            )
        elif not _available(name):
            raise ValueError(f"log_with={name!r} needs the tensorboard package: pip install tensorboard")
        else:
            resolved.append(name)
    return resolved


class TrackingMixin:
    """Accelerate's tracking methods; trackers run on the main process only."""

    log_with: list[str | GeneralTracker]
    trackers: list[GeneralTracker]

    @property
    def logging_dir(self) -> str | None:
        """Where file-based trackers write (the ``Accelerator`` answers)."""
        raise NotImplementedError

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start every tracker of ``log_with`` (on the main process) and store ``config`` in each.

        Raises:
            ValueError: If a tracker needs a logging directory and none is configured.

        """
        if not PartialState().is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                self.trackers.append(item)
                continue
            tracker_cls = _BUILT_IN[item]
            if tracker_cls.requires_logging_directory and self.logging_dir is None:
                raise ValueError(f"Tracker {item!r} writes files: pass Accelerator(project_dir=...) (or logging_dir).")
            args = (project_name, self.logging_dir) if tracker_cls.requires_logging_directory else (project_name,)
            self.trackers.append(tracker_cls(*args, **init_kwargs.get(item, {})))
        for tracker in self.trackers:
            tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` to every started tracker (on the main process)."""
        if not PartialState().is_main_process:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its underlying object with ``unwrap``); a no-op tracker elsewhere.

        Raises:
            ValueError: On the main process, when no tracker has that name.

        """
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if PartialState().is_main_process:
            raise ValueError(f"No started tracker is called {name!r}; started: {[t.name for t in self.trackers]}.")
        return GeneralTracker()

    def _finish_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
