"""Accelerate's ``ProfileKwargs``: the settings of a ``torch.profiler.profile`` run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_accel.config.kwargs import KwargsHandler

__all__ = ["ProfileKwargs"]

_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


def _activities() -> dict[str, torch.profiler.ProfilerActivity]:
    """The profiler activities this machine can record, by Accelerate's names."""
    found = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
    if hasattr(torch, "hpu") and torch.hpu.is_available():
        found["hpu"] = torch.profiler.ProfilerActivity.HPU
    if torch.xpu.is_available():
        found["xpu"] = torch.profiler.ProfilerActivity.XPU
    if torch.mtia.is_available():
        found["mtia"] = torch.profiler.ProfilerActivity.MTIA
    return found


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings for ``torch.profiler.profile`` (see its documentation for each).

    Attributes:
        activities: What to record: ``"cpu"``, ``"cuda"``, and where present ``"xpu"``, ``"mtia"``, ``"hpu"``;
            ``None`` is torch's default (CPU, and CUDA when available).
        schedule_option: Arguments of ``torch.profiler.schedule``: ``wait``, ``warmup``, ``active``, ``repeat``,
            ``skip_first``.
        on_trace_ready: Called with the profiler when a recording cycle ends.
        record_shapes: Record operators' input shapes.
        profile_memory: Track tensor allocations and frees.
        with_stack: Record the source location of operators.
        with_flops: Estimate FLOPs of matrix products and convolutions.
        with_modules: Record the module hierarchy of operators.
        output_trace_dir: Where the ``Accelerator`` writes a Chrome trace (``None``: none is written).

    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.schedule_option or {}) - set(_SCHEDULE_KEYS))
        if unknown:
            raise ValueError(f"schedule_option has unknown keys {unknown}; use {list(_SCHEDULE_KEYS)}")
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            raise TypeError(f"on_trace_ready must be callable or None, got {self.on_trace_ready!r}")

    def _get_profiler_activity(self, activity: str) -> torch.profiler.ProfilerActivity:
        """The torch activity for one of Accelerate's activity names.

        Raises:
            ValueError: For a name this machine cannot record.

        """
        available = _activities()
        if activity not in available:
            raise ValueError(f"Invalid profiler activity {activity!r}: this machine records {list(available)}")
        return available[activity]

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` with these settings (not started).

        Raises:
            ValueError: For an activity this machine cannot record.

        """
        activities = None
        if self.activities is not None:
            activities = [self._get_profiler_activity(activity) for activity in self.activities]
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )
