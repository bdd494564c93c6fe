"""Accelerate's trackers that lightning_accel does not implement yet: Aim, ClearML, DVCLive, SwanLab and Trackio.

The classes exist under Accelerate's names so that code importing them keeps importing. Constructing one fails with
the reason: an ``ImportError`` naming the ``pip install`` command when its package is missing, and otherwise a
``NotImplementedError`` (there is no implementation to run, and a tracker that silently logs nothing would lose a
run's metrics). Write a :class:`~lightning_accel.tracking.GeneralTracker` subclass for such a service in the meantime.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, ClassVar

from lightning_accel.tracking.base import GeneralTracker

__all__ = ["AimTracker", "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker", "TrackioTracker"]


class _UnimplementedTracker(GeneralTracker):
    """A tracker known by name whose implementation lightning_accel lacks; constructing it raises."""

    package: ClassVar[str] = ""
    install: ClassVar[str] = ""

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        del run_name, kwargs
        self._refuse()

    def _refuse(self) -> None:
        cls = type(self)
        if importlib.util.find_spec(cls.package) is None:
            raise ImportError(f"{cls.__name__} needs the {cls.package!r} package: {cls.install}")
        raise NotImplementedError(
            f"{cls.__name__} ({cls.name!r}) is not implemented in lightning_accel yet, although {cls.package!r} is "
            "installed; log through a GeneralTracker subclass passed to Accelerator(log_with=...) instead, or use "
            "one of the built-in trackers: tensorboard, wandb, comet_ml, mlflow"
        )


class AimTracker(_UnimplementedTracker):
    """Aim (``log_with="aim"``); not implemented here: constructing it raises ``ImportError``/``NotImplementedError``.

    Raises:
        ImportError: Without the ``aim`` package (``pip install 'aim<4'``: the 3.x API).
        NotImplementedError: With it.

    """

    name = "aim"
    requires_logging_directory = True
    package = "aim"
    install = "pip install 'aim<4'"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any) -> None:
        del run_name, logging_dir, kwargs
        self._refuse()


class ClearMLTracker(_UnimplementedTracker):
    """ClearML (``log_with="clearml"``); not implemented here: constructing it raises.

    Raises:
        ImportError: Without the ``clearml`` package (``pip install clearml``).
        NotImplementedError: With it.

    """

    name = "clearml"
    package = "clearml"
    install = "pip install clearml"

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        del run_name, kwargs
        self._refuse()


class DVCLiveTracker(_UnimplementedTracker):
    """DVCLive (``log_with="dvclive"``); not implemented here: constructing it raises.

    Raises:
        ImportError: Without the ``dvclive`` package (``pip install dvclive``).
        NotImplementedError: With it.

    """

    name = "dvclive"
    package = "dvclive"
    install = "pip install dvclive"

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs: Any) -> None:
        del run_name, live, kwargs
        self._refuse()


class SwanLabTracker(_UnimplementedTracker):
    """SwanLab (``log_with="swanlab"``); not implemented here: constructing it raises.

    Raises:
        ImportError: Without the ``swanlab`` package (``pip install swanlab``).
        NotImplementedError: With it.

    """

    name = "swanlab"
    package = "swanlab"
    install = "pip install swanlab"


class TrackioTracker(_UnimplementedTracker):
    """Trackio (``log_with="trackio"``); not implemented here: constructing it raises.

    Raises:
        ImportError: Without the ``trackio`` package (``pip install trackio``).
        NotImplementedError: With it.

    """

    name = "trackio"
    package = "trackio"
    install = "pip install trackio"
