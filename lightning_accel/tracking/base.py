"""The tracker interface (:class:`GeneralTracker`) and the decorator keeping tracker calls on the main process."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from lightning_accel.state import PartialState

__all__ = ["GeneralTracker", "as_python_scalar", "import_tracker_package", "on_main_process"]

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
