"""Accelerate's ``get_logger``: a logger that logs on the main process only unless told otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from typing_extensions import override

from lightning_accel.state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` taking ``main_process_only=True`` (default) and ``in_order=False`` per call.

    With ``main_process_only`` only the global main process logs; with ``in_order`` every process logs, one after the
    other in rank order (a barrier per process).
    """

    @override
    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        # Counted from this method, as in Accelerate (the default names our caller's caller); +1 for _emit's frame.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if in_order:
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self._emit(level, msg, args, kwargs)
                state.wait_for_everyone()
        elif not main_process_only or state.is_main_process:
            self._emit(level, msg, args, kwargs)

    def _emit(self, level: int, msg: object, args: Any, kwargs: MutableMapping[str, Any]) -> None:
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for ``name`` that logs on the main process only (``main_process_only=False`` logs everywhere).

    Args:
        name: The logger name, usually ``__name__``.
        log_level: A level name such as ``"INFO"``; ``None`` reads ``ACCELERATE_LOG_LEVEL`` (unset: unchanged).

    Raises:
        ValueError: For an unknown level name.

    """
    level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        if not isinstance(logging.getLevelName(level.upper()), int):
            raise ValueError(f"Unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL.")
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
