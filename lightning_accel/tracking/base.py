"""The tracker interface (:class:`GeneralTracker`) and the decorator keeping tracker calls on the main process."""

from __future__ import annotations

import abc
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, TypeVar, cast

import torch
from typing_extensions import override

from lightning_accel.state import PartialState

__all__ = [
    "GeneralTracker",
    "KindWriters",
    "as_python_scalar",
    "import_tracker_package",
    "log_by_kind",
    "on_main_process",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def on_main_process(function: _F) -> _F:
    """Run a tracker method only on the main process when its tracker has ``main_process_only`` set.

    The process is looked up when the method is called, so trackers can be built before the ``Accelerator``.
    Elsewhere the method returns ``None``.
    """

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return cast(_F, wrapper)


def import_tracker_package(module: str, install: str) -> Any:
    """Import a tracker's package, or fail with the command that installs it.

    Raises:
        ImportError: If ``module`` is not installed.

    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ImportError(f"This tracker needs the {module!r} package: {install}") from err


def as_python_scalar(value: Any) -> Any:
    """A one-element tensor as its Python number (what tracker packages accept); any other value unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


class KindWriters(NamedTuple):
    """Where each of Accelerate's value kinds goes: numbers, strings, and dicts of numbers (a group)."""

    number: Callable[[str, float], object]
    text: Callable[[str, str], object]
    group: Callable[[str, dict[str, Any]], object]


def log_by_kind(
    package: str,
    values: Mapping[str, Any],
    writers: KindWriters,
    scalar: Callable[[Any], Any] = as_python_scalar,
) -> None:
    """Hand each value to the writer of its kind, after ``scalar`` turned tensors into numbers.

    Args:
        package: The tracker's package, for the error.
        values: Key to value, as given to ``log``.
        writers: One writer per kind, each called with the key and the value.
        scalar: Turns the tensors the tracker takes as numbers into them (default: one-element tensors).

    Raises:
        TypeError: For a value of another kind.

    """
    for key, raw in values.items():
        value = scalar(raw)
        if isinstance(value, (int, float)):
            writers.number(key, value)
        elif isinstance(value, str):
            writers.text(key, value)
        elif isinstance(value, dict):
            writers.group(key, value)
        else:
            raise TypeError(f"{package} cannot log {key}={type(value).__name__}; log numbers, strings or dicts.")


class GeneralTracker:
    """Base of every tracker: override ``start``, ``store_init_configuration``, ``log``, ``finish`` and ``tracker``.

    A subclass is either passed to ``Accelerator(log_with=...)`` as an object, or registered by name with
    :func:`~lightning_accel.tracking.register_tracker_class`; then ``init_trackers`` builds it as
    ``cls(project_name, [logging_dir,] **init_kwargs[name])``.

    Attributes:
        name: How ``init_kwargs``/``log_kwargs`` and ``get_tracker`` refer to it.
        requires_logging_directory: Whether the ``Accelerator`` passes its ``logging_dir`` to the constructor.
        main_process_only: Whether methods decorated with :func:`on_main_process` run on the main process only.

    """

    name: str = ""
    requires_logging_directory: bool = False
    main_process_only: bool = True

    def start(self) -> None:
        """Open the run (called by ``init_trackers``)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (e.g. a ``SummaryWriter``, a wandb run)."""
        return None

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Close the run."""


class _Table(NamedTuple):
    """A table as ``log_table`` receives it: a header and rows, or a dataframe."""

    columns: list[str] | None
    data: list[list[Any]] | None
    dataframe: Any


class _RunTracker(GeneralTracker, abc.ABC):
    """A tracker over one run object of its package, opened by ``start`` and closed by ``finish``.

    The public methods are gated by :func:`on_main_process` here, once; a subclass says only how its package opens
    the run (``_open_run``), stores the configuration (``_store_config``), logs values (``_log_values``) and closes
    the run (``_close_run``, by default ``run.finish()``).

    Args:
        run_name: The project name given to ``init_trackers``.
        **kwargs: The tracker's ``init_kwargs`` entry, for the package's run constructor.

    """

    # The tracker's package and the command that installs it, for ``_package``.
    _package_name: ClassVar[str] = ""
    _install: ClassVar[str] = ""

    def __init__(self, run_name: str | None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def _package(self) -> Any:
        """The tracker's package, imported when first asked for.

        Raises:
            ImportError: If it is not installed (the message says how to install it).

        """
        return import_tracker_package(self._package_name, self._install)

    @abc.abstractmethod
    def _open_run(self) -> Any:
        """Open and return the package's run object."""

    @abc.abstractmethod
    def _store_config(self, values: dict[str, Any]) -> Any:
        """Record ``values`` in the open run."""

    @abc.abstractmethod
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """Record ``values`` at ``step`` in the open run, with the package's own keyword arguments."""

    def _close_run(self) -> None:
        self.run.finish()

    @override
    @on_main_process
    def start(self) -> None:
        self.run = self._open_run()

    @property
    @override
    def tracker(self) -> Any:
        """The package's run object (``None`` before ``start`` and off the main process)."""
        return self.run

    @override
    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> Any:
        return self._store_config(dict(values))

    @override
    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._log_values(values, step, kwargs)

    @override
    @on_main_process
    def finish(self) -> None:
        self._close_run()


class _RunAlias:
    """Accelerate's read-only name for a tracker's run object (``writer``, ``task``, ``live``).

    Args:
        doc: What the run object is.

    """

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __get__(self, tracker: _RunTracker | None, owner: type | None = None) -> Any:
        return self if tracker is None else tracker.run

    def __set__(self, tracker: _RunTracker, value: Any) -> None:
        raise AttributeError("read-only: it is the tracker's `run`")


class _TableTracker(_RunTracker):
    """A run tracker that also logs tables, with Accelerate's ``log_table`` signature."""

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a table built from ``columns`` and ``data`` (rows), or from ``dataframe``."""
        self._log_table(table_name, _Table(columns, data, dataframe), step, kwargs)

    @abc.abstractmethod
    def _log_table(self, table_name: str, table: _Table, step: int | None, kwargs: dict[str, Any]) -> None:
        """Log ``table`` under ``table_name`` at ``step`` in the open run."""
