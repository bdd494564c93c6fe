"""Tracker names: the built-in table, registration of custom classes, and ``log_with`` resolution.

A built-in tracker is available when its package can be found (``importlib.util.find_spec`` and, for the five
checked by ``lightning_accel.utils.imports``, its installed distribution, Aim's below 4.0): nothing is imported.
Unlike Accelerate, which drops a named tracker whose package is missing (with a debug message), naming one raises
an ``ImportError`` with the install command; ``"all"`` takes the built-in trackers whose packages are installed,
as Accelerate does.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_accel.enums import LoggerType
from lightning_accel.tracking.aim import AIM_INSTALL, AimTracker
from lightning_accel.tracking.base import GeneralTracker
from lightning_accel.tracking.clearml import CLEARML_INSTALL, ClearMLTracker
from lightning_accel.tracking.comet import COMET_INSTALL, CometMLTracker
from lightning_accel.tracking.dvclive import DVCLIVE_INSTALL, DVCLiveTracker
from lightning_accel.tracking.mlflow import MLFLOW_INSTALL, MLflowTracker
from lightning_accel.tracking.swanlab import SWANLAB_INSTALL, SwanLabTracker
from lightning_accel.tracking.tensorboard import TensorBoardTracker
from lightning_accel.tracking.trackio import TRACKIO_INSTALL, TrackioTracker
from lightning_accel.tracking.wandb import WANDB_INSTALL, WandBTracker
from lightning_accel.utils.imports import (
    is_aim_available,
    is_clearml_available,
    is_dvclive_available,
    is_swanlab_available,
    is_trackio_available,
)

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "check_logging_dir",
    "filter_trackers",
    "get_available_trackers",
    "register_tracker_class",
    "resolve_trackers",
]

LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "comet_ml": CometMLTracker,
    "aim": AimTracker,
    "mlflow": MLflowTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}


def _any_module(*modules: str) -> Callable[[], bool]:
    return lambda: any(importlib.util.find_spec(module) is not None for module in modules)


# Built-in name -> (whether its package is usable here, the install command), in Accelerate's order for "all".
_PACKAGES: dict[str, tuple[Callable[[], bool], str]] = {
    "tensorboard": (_any_module("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "wandb": (_any_module("wandb"), WANDB_INSTALL),
    "comet_ml": (_any_module("comet_ml"), COMET_INSTALL),
    "aim": (is_aim_available, AIM_INSTALL),  # 3.x only: Aim 4 has another API
    "mlflow": (_any_module("mlflow"), MLFLOW_INSTALL),
    "clearml": (is_clearml_available, CLEARML_INSTALL),
    "dvclive": (is_dvclive_available, DVCLIVE_INSTALL),
    "swanlab": (is_swanlab_available, SWANLAB_INSTALL),
    "trackio": (is_trackio_available, TRACKIO_INSTALL),
}
_BUILT_IN = tuple(_PACKAGES)


def _installed(name: str) -> bool:
    available, _ = _PACKAGES[name]
    return available()


def get_available_trackers() -> list[str]:
    """The built-in tracker names whose packages are installed (what ``log_with="all"`` selects)."""
    return [name for name in _BUILT_IN if _installed(name)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a :class:`GeneralTracker` subclass selectable by its ``name`` in ``log_with`` (before the Accelerator).

    ``init_trackers`` builds it as ``tracker_class(project_name, [logging_dir,] **init_kwargs[name])``.

    Raises:
        ValueError: If it is not a ``GeneralTracker`` subclass, has no ``name``, or does not set
            ``requires_logging_directory`` itself (the base class's default does not count, as in Accelerate).

    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class takes a GeneralTracker subclass, got {tracker_class!r}.")
    if not tracker_class.name:
        raise ValueError(f"{tracker_class.__name__} needs a non-empty class attribute `name` to be registered.")
    declared = any(
        "requires_logging_directory" in vars(klass)
        for klass in tracker_class.__mro__[:-1]
        if klass is not GeneralTracker
    )
    if not declared:
        raise ValueError(
            f"{tracker_class.__name__} must set the class attribute `requires_logging_directory` (True when it writes "
            "under the Accelerator's logging directory, which init_trackers then passes as its second argument)."
        )
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(
            f"Tracker name {tracker_class.name!r} now selects {tracker_class.__name__} instead of"
            f" {LOGGER_TYPE_TO_CLASS[tracker_class.name].__name__}.",
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def _check_name(item: Any) -> str:
    """The tracker name ``item`` stands for, checked to be usable here."""
    supported = sorted(LOGGER_TYPE_TO_CLASS)
    if not isinstance(item, (str, LoggerType)):
        raise ValueError(f"Unknown tracker {item!r}; use one of {supported}, 'all', or a GeneralTracker.")
    name = str(getattr(item, "value", item))
    name = name if name in LOGGER_TYPE_TO_CLASS else name.lower()
    if name in LOGGER_TYPE_TO_CLASS or name == "all":
        if name in _PACKAGES and not _installed(name):
            raise ImportError(f"log_with={name!r} needs its package: {_PACKAGES[name][1]}")
        return name
    raise ValueError(f"Unknown tracker {item!r}; use one of {supported}, 'all', or a GeneralTracker.")


def resolve_trackers(log_with: Any) -> list[str | GeneralTracker]:
    """Normalise ``log_with`` to tracker names and tracker objects, without repeats.

    ``"all"`` adds every built-in tracker whose package is installed; names and objects may be mixed with it.

    Raises:
        ValueError: For an unknown name or one lightning_accel does not support.
        ImportError: For a tracker named explicitly whose package is not installed.

    """
    items = log_with if isinstance(log_with, Sequence) and not isinstance(log_with, str) else [log_with]
    resolved: list[str | GeneralTracker] = []
    for item in items:
        if item is None:
            continue
        names = [item] if isinstance(item, GeneralTracker) else [_check_name(item)]
        if names == ["all"]:
            names = list(get_available_trackers())
            if not names:
                warnings.warn("log_with='all' found no tracker package installed: nothing is logged.", stacklevel=3)
        resolved.extend(entry for entry in names if entry not in resolved)
    return resolved


def check_logging_dir(log_with: Sequence[str | GeneralTracker], logging_dir: str | None) -> None:
    """Check that a logging directory is set when a named tracker needs one.

    Raises:
        ValueError: Naming the trackers that write files, when ``logging_dir`` is ``None``.

    """
    if logging_dir is not None:
        return
    needing = [i for i in log_with if isinstance(i, str) and LOGGER_TYPE_TO_CLASS[i].requires_logging_directory]
    if needing:
        names = ", ".join(f"`{name}`" for name in needing)
        raise ValueError(
            f"Logging with {names} requires a `logging_dir`: pass Accelerator(project_dir=...) (or"
            " ProjectConfiguration(logging_dir=...))."
        )


def filter_trackers(log_with: Any, logging_dir: str | None = None) -> list[str | GeneralTracker]:
    """Accelerate's name for :func:`resolve_trackers` followed by :func:`check_logging_dir`."""
    trackers = resolve_trackers(log_with)
    check_logging_dir(trackers, logging_dir)
    return trackers
