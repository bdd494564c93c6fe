"""Accelerate's ``get_logger``: a logger that logs on the main process only unless told otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, MutableMapping
from typing import Any, Protocol

import torch.distributed as dist
from typing_extensions import override

from lightning_accel.state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` for several processes, as Accelerate's: each message starts with ``[RANK <i>]``.

    Every logging call takes two more keywords: ``main_process_only=True`` (the default) logs on the global main
    process only, ``False`` on every process; ``in_order=True`` has every process log, one after the other in rank
    order (a barrier per process; ``main_process_only`` is then ignored). ``warning_once`` logs a warning once per
    distinct call on this adapter; its record names the caller (Accelerate's names ``warning_once`` itself).

    Unlike Accelerate's, it logs before any ``PartialState``/``Accelerator`` exists (Accelerate raises
    ``RuntimeError``): the processes are then those of ``torch.distributed``'s default group, one without it, which
    is what a Lightning ``Trainer`` run has.
    """

    @override
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefix ``msg`` with this process's rank; leave out this adapter's frame when the record names its caller."""
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {_processes().process_index}] {msg}", kwargs

    @override
    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` where ``main_process_only`` and ``in_order`` say (see the class)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, options = self.process(msg, kwargs)
        processes = _processes()
        if not in_order:
            if not main_process_only or processes.process_index == 0:
                self.logger.log(level, msg, *args, **options)
            return
        for rank in range(processes.num_processes):
            if rank == processes.process_index:
                self.logger.log(level, msg, *args, **options)
            processes.wait_for_everyone()

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


class _Processes(Protocol):
    """What the adapter asks of the processes of the run."""

    @property
    def process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    def wait_for_everyone(self) -> None: ...


class _DefaultGroup:
    """The processes of ``torch.distributed``'s default group (one process without it), for logging before a state."""

    @property
    def process_index(self) -> int:
        return dist.get_rank() if _group_exists() else 0

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if _group_exists() else 1

    def wait_for_everyone(self) -> None:
        if _group_exists():
            dist.barrier()


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def _processes() -> _Processes:
    """The run's ``PartialState`` where one exists, without creating one (which would join a launch)."""
    return PartialState() if PartialState._shared_state else _DefaultGroup()


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
