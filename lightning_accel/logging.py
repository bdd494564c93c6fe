"""Accelerate's ``get_logger``: a logger that logs on the main process only unless told otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, MutableMapping
from typing import Any

from typing_extensions import override

from lightning_accel.state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` for several processes, as Accelerate's: each message starts with ``[RANK <i>]``.

    Every logging call takes two more keywords: ``main_process_only=True`` (the default) logs on the global main
    process only, ``False`` on every process; ``in_order=True`` has every process log, one after the other in rank
    order (a barrier per process; ``main_process_only`` is then ignored). ``warning_once`` logs a warning once per
    distinct call on this adapter; its record names the caller (Accelerate's names ``warning_once`` itself).
    """

    @override
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefix ``msg`` with this process's rank; leave out this adapter's frame when the record names its caller."""
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    @override
    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` where ``main_process_only`` and ``in_order`` say (see the class).

        Raises:
            RuntimeError: Before any ``PartialState``/``Accelerator`` exists (the processes of the run are unknown).

        """
        if not PartialState._shared_state:  # checked without creating one, which would join a launch
            raise RuntimeError(
                "get_logger's logger needs the processes of the run: create a PartialState() or an Accelerator()"
                " before logging with it."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, options = self.process(msg, kwargs)
        state = PartialState()
        if not in_order:
            if not main_process_only or state.is_main_process:
                self.logger.log(level, msg, *args, **options)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **options)
            state.wait_for_everyone()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning(*args, **kwargs)``, the first time this adapter gets exactly these arguments only.

        Raises:
            TypeError: For an argument that cannot be hashed (it could not be recognised the next time).

        """
        seen: set[Hashable] = self.__dict__.setdefault("_warned_once", set())
        key = (args, tuple(sorted(kwargs.items())))
        if key in seen:
            return
        seen.add(key)
        options = {**kwargs, "stacklevel": int(kwargs.get("stacklevel", 2)) + 1}  # name our caller, not this method
        self.warning(*args, **options)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for ``name`` that logs on the main process only (``main_process_only=False`` logs everywhere).

    Args:
        name: The logger name, usually ``__name__``.
        log_level: A level name such as ``"INFO"``; ``None`` reads ``ACCELERATE_LOG_LEVEL`` (unset: unchanged). The
            level is set on the named logger and on the root logger, as Accelerate does.

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
