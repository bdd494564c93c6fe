"""Aim (``log_with="aim"``), on the ``aim`` package's 3.x ``Run`` (a local repository under ``logging_dir``).

As in Accelerate, the run is ``aim.Run(repo=logging_dir, **init_kwargs["aim"])`` named after ``project_name``, the
configuration is the run's ``"hparams"`` attribute and each logged value is one ``Run.track`` call at the given step.
Aim needs no server or network: the repository is files (RocksDB chunks) that ``aim.Repo`` reads back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _RunAlias, _RunTracker, as_python_scalar, on_main_process

__all__ = ["AIM_INSTALL", "AimTracker"]

AIM_INSTALL = "pip install 'aim<4'  (the 3.x API)"


class AimTracker(_RunTracker):
    """An Aim run in the repository at ``logging_dir``: ``aim.Run(repo=logging_dir, **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers``; it becomes the run's name.
        logging_dir: The Aim repository (the Accelerator passes its logging directory); a ``repo`` keyword wins.
        **kwargs: Passed to ``aim.Run`` (``init_kwargs={"aim": {...}}``): ``experiment``,
            ``system_tracking_interval``, ...

    """

    name = "aim"
    _package_name = "aim"
    _install = AIM_INSTALL
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any) -> None:
        self.aim_repo_path = kwargs.pop("repo", logging_dir)
        super().__init__(run_name, **kwargs)

    writer = _RunAlias("The ``aim.Run`` (Accelerate's attribute name).")

    @override
    def _open_run(self) -> Any:
        repo = None if self.aim_repo_path is None else str(self.aim_repo_path)
        run = self._package().Run(repo=repo, **self.init_kwargs)
        run.name = self.run_name
        return run

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Store ``values`` as the run's ``"hparams"`` attribute."""
        self.run["hparams"] = values

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """One ``Run.track(value, name=key, step=step, **kwargs)`` per value.

        Aim takes numbers (one-element tensors are turned into them) and Aim objects such as ``aim.Text``; it raises
        ``ValueError`` for anything else.
        """
        for key, value in values.items():
            self.run.track(as_python_scalar(value), name=key, step=step, **kwargs)

    @on_main_process
    def log_images(
        self, values: Mapping[str, Any], step: int | None = None, kwargs: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """Track each value, an image or an ``(image, caption)`` pair, as an ``aim.Image``.

        Args:
            values: Key to a numpy array or PIL image, or a pair of one and its caption.
            step: The step of every image.
            kwargs: Accelerate's layout: ``{"aim_image": {...}}`` for ``aim.Image``, ``{"track": {...}}`` for
                ``Run.track``.

        """
        aim = self._package()
        image_kwargs = dict((kwargs or {}).get("aim_image", {}))
        track_kwargs = dict((kwargs or {}).get("track", {}))
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.run.track(aim.Image(image, caption=caption, **image_kwargs), name=key, step=step, **track_kwargs)

    @override
    def _close_run(self) -> None:
        self.run.close()
