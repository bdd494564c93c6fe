"""Weights & Biases (``log_with="wandb"``), on the ``wandb`` package directly.

Lightning's ``WandbLogger`` is not used: it logs the step as a ``trainer/global_step`` metric (with ``define_metric``)
instead of passing it to ``run.log(step=...)``, and defaults the project to ``lightning_logs``. Accelerate's runs
keep wandb's own ``_step`` equal to the step given to ``Accelerator.log`` and name the project after
``init_trackers``' ``project_name``; this tracker does the same, so runs compare one to one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import override

from lightning_accel.tracking.base import _Table, _TableTracker, on_main_process

__all__ = ["WANDB_INSTALL", "WandBTracker"]

WANDB_INSTALL = "pip install 'lightning-accel[wandb]'"


class WandBTracker(_TableTracker):
    """A wandb run: ``wandb.init(project=run_name, **kwargs)``; offline with ``WANDB_MODE=offline``.

    Args:
        run_name: The project name given to ``init_trackers`` (wandb's ``project``).
        **kwargs: Passed to ``wandb.init`` (``init_kwargs={"wandb": {...}}``): ``name``, ``dir``, ``mode``, ``tags``...

    Raises:
        ValueError: If ``kwargs`` sets ``project`` (it is ``run_name``).

    """

    name = "wandb"
    _package_name = "wandb"
    _install = WANDB_INSTALL
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        if "project" in kwargs:
            raise ValueError(
                f"init_kwargs['wandb'] sets project={kwargs['project']!r}: the wandb project is init_trackers'"
                f" project_name ({run_name!r}); pass the name there."
            )
        super().__init__(run_name, **kwargs)

    @override
    def _open_run(self) -> Any:
        return self._package().init(project=self.run_name, **self.init_kwargs)

    @override
    def _store_config(self, values: dict[str, Any]) -> None:
        """Update the run's config (values may change, as in Accelerate)."""
        self.run.config.update(values, allow_val_change=True)

    @override
    def _log_values(self, values: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> None:
        """``run.log(values, step=step, **kwargs)``: the step is wandb's ``_step``."""
        self.run.log(dict(values), step=step, **kwargs)

    @on_main_process
    def log_images(self, values: Mapping[str, Sequence[Any]], step: int | None = None, **kwargs: Any) -> None:
        """Log each key's images (arrays, tensors or PIL images) as a list of ``wandb.Image``, one call per key."""
        wandb = self._package()
        for key, images in values.items():
            self.log({key: [wandb.Image(image) for image in images]}, step=step, **kwargs)

    @override
    def _log_table(self, table_name: str, table: _Table, step: int | None, kwargs: dict[str, Any]) -> None:
        """Log a ``wandb.Table`` built from ``columns`` and ``data``, or from ``dataframe``."""
        wandb_table = self._package().Table(columns=table.columns, data=table.data, dataframe=table.dataframe)
        self.log({table_name: wandb_table}, step=step, **kwargs)
