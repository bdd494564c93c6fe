"""``Accelerator.profile``: ``torch.profiler`` around a block, and a Chrome trace per process as Accelerate writes."""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_accel.config.profile import ProfileKwargs
from lightning_accel.state import AcceleratorState
from lightning_accel.utils.constants import PROFILE_PATTERN_NAME

__all__ = ["profiled"]


@contextmanager
def profiled(
    profile_handler: Any, default_handler: ProfileKwargs | None, state: AcceleratorState
) -> Generator[torch.profiler.profile, None, None]:
    """``torch.profiler`` around the body, writing each process's Chrome trace as Accelerate's ``profile`` does.

    Args:
        profile_handler: The settings for this block, or ``None``.
        default_handler: The ``ProfileKwargs`` among the ``Accelerator``'s ``kwargs_handlers``, if any.
        state: The processes (whose index names the trace and which wait for each other after writing).

    Raises:
        TypeError: If ``profile_handler`` is not a ``ProfileKwargs``.

    """
    if profile_handler is not None and not isinstance(profile_handler, ProfileKwargs):
        raise TypeError(f"profile_handler must be a ProfileKwargs, got {type(profile_handler).__name__}.")
    handler = profile_handler or default_handler or ProfileKwargs()
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    os.makedirs(handler.output_trace_dir, exist_ok=True)
    trace = os.path.join(handler.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=state.process_index))
    profiler.export_chrome_trace(trace)
    state.wait_for_everyone()
