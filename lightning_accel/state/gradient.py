"""``GradientState``: the gradient-accumulation settings and the live state of the training loop."""

from __future__ import annotations

import weakref
from typing import Any

from lightning_accel.config import GradientAccumulationPlugin
from lightning_accel.state.shared import _SharedState

__all__ = ["GradientState"]


class GradientState(_SharedState):
    """Gradient-accumulation settings and the live state of the loop.

    Attributes:
        sync_gradients: Whether the current micro-step synchronises gradients and steps the optimizer.
        plugin_kwargs: The accumulation plugin's non-default fields (Accelerate stores ``to_kwargs()``, so its
            getters' own defaults apply to the rest: ``adjust_scheduler`` reads ``False`` unless set).

    Args:
        gradient_accumulation_plugin: Settings of the run; only the first instance of a process applies them.

    """

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None) -> None:
        super().__init__()
        if not self.initialized:
            self.sync_gradients = True
            self._references: list[weakref.ref[Any]] = []
            self.plugin_kwargs: dict[str, Any] = {}
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return int(self.plugin_kwargs.get("num_steps", 1))

    @property
    def adjust_scheduler(self) -> bool:
        """Whether a skipped scheduler step still advances its counter."""
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the last batch of a data loader always synchronises."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised at every micro-batch."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_dataloader(self) -> Any | None:
        """The innermost data loader being iterated, if any."""
        for ref in self._references:  # newest first; the first live one (read every micro-step: no lists built)
            loader = ref()
            if loader is not None:
                return loader
        return None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active data loader yielded (or is yielding) its last batch."""
        for ref in self._references:  # active_dataloader's walk, without its call: read every micro-step
            loader = ref()
            if loader is not None:
                return bool(loader.end_of_dataloader)
        return False

    @property
    def remainder(self) -> int:
        """Samples in the active loader's last global batch (``-1`` when unknown or not iterating)."""
        loader = self.active_dataloader
        return -1 if loader is None else int(loader.remainder)

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self._references = [weakref.ref(dataloader), *self._references]

    def _remove_dataloader(self, dataloader: Any) -> None:
        self._references = [ref for ref in self._references if ref() is not dataloader and ref() is not None]
