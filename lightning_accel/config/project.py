"""Project, data loader and gradient accumulation settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_accel.config._validation import check_bool, check_non_negative_int, check_positive_int
from lightning_accel.config.kwargs import KwargsHandler

__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration"]


def _as_optional_path(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {value!r}")
    return os.fspath(value)


@dataclass
class ProjectConfiguration:
    """Where a project writes checkpoints and logs, and how checkpoints are named and rotated.

    Attributes:
        project_dir: Root directory for checkpoints (``<project_dir>/checkpoints/checkpoint_<i>`` with automatic
            naming).
        logging_dir: Directory for file-based trackers; falls back to ``project_dir`` when ``None``.
        automatic_checkpoint_naming: Whether ``save_state`` picks ``checkpoint_<iteration>`` names itself.
        total_limit: Number of automatically named checkpoints to keep (oldest are deleted); ``None`` keeps all.
        iteration: Index of the next automatically named checkpoint.
        save_on_each_node: Whether every node (not only the global main process) writes checkpoints.

    ``os.PathLike`` directories are stored as ``str``.

    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        self.logging_dir = _as_optional_path("logging_dir", self.logging_dir)
        self.set_directories(self.project_dir)
        check_bool("automatic_checkpoint_naming", self.automatic_checkpoint_naming)
        check_positive_int("total_limit", self.total_limit, optional=True)
        check_non_negative_int("iteration", self.iteration)
        check_bool("save_on_each_node", self.save_on_each_node)

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``; ``logging_dir`` follows it unless it was set explicitly.

        Args:
            project_dir: The new project directory, or ``None``.

        """
        self.project_dir = _as_optional_path("project_dir", project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class DataLoaderConfiguration:
    """How the Accelerator prepares data loaders.

    Attributes:
        split_batches: If ``True``, each loader batch is split across processes (the batch size must be a multiple
            of the number of processes); if ``False``, every process draws full batches of its own.
        dispatch_batches: If ``True``, only the main process iterates the loader and batches are sent to the
            others; ``None`` enables it for iterable-style datasets only.
        even_batches: Whether samples from the start are repeated so every process gets the same number of batches.
        use_seedable_sampler: Whether shuffling uses a sampler seeded from ``data_seed`` and the epoch, which makes
            the order reproducible.
        data_seed: Seed of the seedable sampler's generator; ``None`` uses torch's current default seed.
        non_blocking: Whether host-to-device copies of batches are non-blocking (use with ``pin_memory=True``).
        use_stateful_dataloader: Whether loaders are ``torchdata`` ``StatefulDataLoader`` objects (needs
            ``torchdata>=0.8``).

    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        check_bool("split_batches", self.split_batches)
        check_bool("dispatch_batches", self.dispatch_batches, optional=True)
        check_bool("even_batches", self.even_batches)
        check_bool("use_seedable_sampler", self.use_seedable_sampler)
        check_non_negative_int("data_seed", self.data_seed, optional=True)
        check_bool("non_blocking", self.non_blocking)
        check_bool("use_stateful_dataloader", self.use_stateful_dataloader)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation settings.

    Attributes:
        num_steps: Number of batches whose gradients are accumulated before an optimizer step; ``None`` leaves
            it to the Accelerator's ``gradient_accumulation_steps``.
        adjust_scheduler: Whether the learning-rate scheduler is stepped ``num_steps`` times per optimizer step, for
            schedulers written in optimizer steps.
        sync_with_dataloader: Whether the last batch of the data loader always triggers a synchronising step.
        sync_each_batch: Whether gradients are synchronised at every batch (less memory, more communication).

    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        check_positive_int("num_steps", self.num_steps, optional=True)
        check_bool("adjust_scheduler", self.adjust_scheduler)
        check_bool("sync_with_dataloader", self.sync_with_dataloader)
        check_bool("sync_each_batch", self.sync_each_batch)
