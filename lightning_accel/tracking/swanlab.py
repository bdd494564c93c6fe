"""SwanLab (``log_with="swanlab"``), on the ``swanlab`` package (``swanlab.init`` and its ``Run``).

As in Accelerate: the project is ``init_trackers``' ``project_name``, the run's config gets a ``FRAMEWORK`` entry
(here ``"lightning_accel"``; Accelerate writes its own name), ``log`` is ``Run.log(values, step=step)`` and images
are lists of ``swanlab.Image``. The configuration is merged with ``swanlab.config.update``; Accelerate also passes
``allow_val_change=True``, which SwanLab 0.10 stores as one more config entry, so it is passed only to a SwanLab
whose ``update`` has that parameter. Offline: ``mode="offline"`` (or ``SWANLAB_MODE=offline``) writes the run under
``log_dir`` (``SWANLAB_LOG_DIR``) for a later ``swanlab sync``; ``mode="local"`` keeps it local for good.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _RunTracker, as_python_scalar, on_main_process

__all__ = ["SWANLAB_INSTALL", "SwanLabTracker"]

SWANLAB_INSTALL = "pip install swanlab"

FRAMEWORK = "lightning_accel"


class SwanLabTracker(_RunTracker):
    """A SwanLab run: ``swanlab.init(project=run_name, **kwargs)``.

    Args:
        run_name: The project name given to ``init_trackers`` (SwanLab's ``project``).
        **kwargs: Passed to ``swanlab.init`` (``init_kwargs={"swanlab": {...}}``): ``name``, ``mode``, ``log_dir``...

    """

    name = "swanlab"
    _package_name = "swanlab"
    _install = SWANLAB_INSTALL
    requires_logging_directory = False
    main_process_only = False

    @override
    def _open_run(self) -> Any:
        swanlab = self._package()
        run = swanlab.init(project=self.run_name, **self.init_kwargs)
        swanlab.config["FRAMEWORK"] = FRAMEWORK
        return run

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Merge ``values`` into the run's config (values may change, as in Accelerate)."""
        config = self._package().config
        if "allow_val_change" in inspect.signature(config.update).parameters:
            config.update(values, allow_val_change=True)
        else:
            config.update(values)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """``Run.log(values, step=step, **kwargs)`` (one-element tensors as numbers)."""
        self.run.log({key: as_python_scalar(value) for key, value in values.items()}, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: Mapping[str, Sequence[Any]], step: int | None = None, **kwargs: Any) -> None:
        """Log each key's images (numpy arrays or PIL images) as a list of ``swanlab.Image``, one call per key."""
        swanlab = self._package()
        for key, images in values.items():
            self.log({key: [swanlab.Image(image) for image in images]}, step=step, **kwargs)
