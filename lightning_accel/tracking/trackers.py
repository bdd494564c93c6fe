"""The ``Accelerator``'s trackers: ``init_trackers``, ``log``, ``get_tracker`` (main process only)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from lightning_accel.config import ProjectConfiguration
from lightning_accel.state import PartialState
from lightning_accel.tracking.base import GeneralTracker
from lightning_accel.tracking.registry import LOGGER_TYPE_TO_CLASS, check_logging_dir

__all__ = ["Trackers"]


class Trackers:
    """The trackers of one ``Accelerator``: built, started and fed on the main process only.

    Args:
        log_with: The trackers to start, by name (:data:`LOGGER_TYPE_TO_CLASS`) or as objects.
        project: Where file-based trackers write (its ``logging_dir``, read when they start).

    Attributes:
        log_with: The trackers ``init_trackers`` starts.
        started: The trackers started on this process (none but on the main process); they stay listed once
            finished, as in Accelerate (scripts read their files through them afterwards).

    """

    def __init__(self, *, log_with: list[str | GeneralTracker], project: ProjectConfiguration) -> None:
        self.log_with = log_with
        self._project = project
        self.started: list[GeneralTracker] = []

    @property
    def logging_dir(self) -> str | None:
        """Where file-based trackers write."""
        return self._project.logging_dir

    def init_trackers(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Start every tracker of ``log_with`` on the main process (see ``Accelerator.init_trackers``)."""
        # Checked on every process: the main process raising alone would leave the others waiting in a collective.
        check_logging_dir(self.log_with, self.logging_dir)
        calls = self._tracker_calls(project_name, init_kwargs)
        if not PartialState().is_main_process:
            return
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                self.started.append(item)
                continue
            args, kwargs = calls[item]
            self.started.append(LOGGER_TYPE_TO_CLASS[item](*args, **kwargs))
        for tracker in self.started:
            tracker.start()
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(config)

    def _tracker_calls(
        self, project_name: str, init_kwargs: Mapping[str, Mapping[str, Any]] | None
    ) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
        """Each named tracker's constructor arguments, bound to its signature (so a wrong keyword fails everywhere).

        Raises:
            TypeError: If ``init_kwargs`` does not map names to dictionaries, or a tracker does not take them.

        """
        if init_kwargs is not None and not (
            isinstance(init_kwargs, Mapping) and all(isinstance(v, Mapping) for v in init_kwargs.values())
        ):
            raise TypeError(
                f"init_trackers(init_kwargs={init_kwargs!r}) maps tracker names to keyword dictionaries, e.g."
                " {'wandb': {'dir': 'runs'}}."
            )
        calls = {}
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                continue
            tracker_cls = LOGGER_TYPE_TO_CLASS[item]
            args = (project_name, self.logging_dir) if tracker_cls.requires_logging_directory else (project_name,)
            kwargs = dict((init_kwargs or {}).get(item, {}))
            try:
                inspect.signature(tracker_cls).bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(
                    f"init_trackers(init_kwargs={{{item!r}: {kwargs!r}}}) does not fit {tracker_cls.__name__}: {err}."
                ) from None
            calls[item] = (args, kwargs)
        return calls

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` to every started tracker (on the main process)."""
        if not PartialState().is_main_process:
            return
        for tracker in self.started:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (see ``Accelerator.get_tracker``)."""
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if PartialState().is_main_process:
            raise ValueError(f"No started tracker is called {name!r}; started: {[t.name for t in self.started]}.")
        return GeneralTracker()

    def finish(self) -> None:
        """Finish every started tracker."""
        for tracker in self.started:
            tracker.finish()
