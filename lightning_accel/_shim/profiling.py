"""``Accelerator.profile``: ``torch.profiler`` around a block, and a Chrome trace per process as Accelerate writes."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager

import torch

from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.state import AcceleratorState
from lightning_accel.utils.constants import PROFILE_PATTERN_NAME

__all__ = ["ProfilingControl"]


class ProfilingControl:
    """Accelerate's ``profile`` context manager, for the ``Accelerator``."""

    profile_handler: ProfileKwargs | None
    state: AcceleratorState

    @contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Generator[torch.profiler.profile, None, None]:
        """Profile the body with ``torch.profiler``; yields the profiler (call ``prof.step()`` with a schedule).

        With ``output_trace_dir`` set, every process writes ``profile_<process_index>.json`` (a Chrome trace) there
        after the block, and the processes wait for each other.

        Args:
            profile_handler: The settings for this block; default the ``ProfileKwargs`` among ``kwargs_handlers``,
                else torch's defaults.

        Raises:
            TypeError: If ``profile_handler`` is not a ``ProfileKwargs``.

        """
        if profile_handler is not None and not isinstance(profile_handler, ProfileKwargs):
            raise TypeError(f"profile_handler must be a ProfileKwargs, got {type(profile_handler).__name__}.")
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        trace = os.path.join(handler.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=self.state.process_index))
        profiler.export_chrome_trace(trace)
        self.state.wait_for_everyone()
