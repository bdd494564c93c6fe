"""Experiment trackers for the ``Accelerator`` (``log_with``, ``init_trackers``, ``log``, ``get_tracker``).

Built in, Accelerate's ten names: ``"tensorboard"`` (through Lightning's ``TensorBoardLogger``), ``"wandb"``,
``"comet_ml"`` and ``"mlflow"`` (on their own packages: see each module for why not Lightning's logger), ``"aim"``,
``"clearml"``, ``"dvclive"``, ``"swanlab"`` and ``"trackio"`` (on their packages, as Accelerate), ``"all"`` (those
whose packages are installed), and any :class:`GeneralTracker`, passed as an object or registered by name. Packages
load when a tracker starts.
"""

from lightning_accel.tracking.aim import AimTracker
from lightning_accel.tracking.base import GeneralTracker, on_main_process
from lightning_accel.tracking.clearml import ClearMLTracker
from lightning_accel.tracking.comet import CometMLTracker
from lightning_accel.tracking.dvclive import DVCLiveTracker
from lightning_accel.tracking.mlflow import MLflowTracker
from lightning_accel.tracking.registry import (
    LOGGER_TYPE_TO_CLASS,
    filter_trackers,
    get_available_trackers,
    register_tracker_class,
    resolve_trackers,
)
from lightning_accel.tracking.swanlab import SwanLabTracker
from lightning_accel.tracking.tensorboard import TensorBoardTracker
from lightning_accel.tracking.trackio import TrackioTracker
from lightning_accel.tracking.wandb import WandBTracker

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
    "resolve_trackers",
]
