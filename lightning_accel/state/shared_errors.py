"""One process fails, every process raises: errors shared over the process group instead of a hang.

Work that runs on one process (the main process writing files, process 0 reading a dispatched batch) leaves the
others waiting in the next collective when it raises; they wait until the process group's timeout (30 minutes by
default) and then fail with a message that does not say what went wrong. :func:`raise_on_every_process` is the
collective that replaces that wait: every process calls it with its own error or ``None``, and if any process had
one, all of them raise it.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

__all__ = ["raise_on_every_process", "require_every_process", "run_where", "shareable"]

_T = TypeVar("_T")


def shareable(error: BaseException) -> BaseException:
    """``error`` itself if it survives pickling, else a ``RuntimeError`` with its type and message.

    Args:
        error: The exception to send to the other processes.

    Returns:
        An exception that ``torch.distributed``'s object collectives can carry.

    """
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def raise_on_every_process(error: BaseException | None, what: str) -> None:
    """Collective: raise on every process if any process passes an error (the lowest rank's wins).

    The process that failed re-raises its own exception object; the others raise a copy of it, with a note naming the
    rank it came from and ``what`` was being done. Without a process group of more than one process it raises
    ``error`` (if any) and returns otherwise.

    Args:
        error: This process's exception, or ``None`` when its part succeeded.
        what: What the processes were doing, for the note (e.g. ``"save_model"``).

    Raises:
        BaseException: The first failing process's exception, on every process.

    """
    if not _distributed():
        if error is not None:
            raise error
        return
    outcomes: list[BaseException | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, shareable(error) if error is not None else None)
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    rank, shared = failed[0]
    if error is not None and rank == dist.get_rank():
        raise error
    add_note = getattr(shared, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(f"(raised on process {rank} during {what}; re-raised here so that no process waits for it)")
    raise shared


def run_where(
    runs_here: bool, function: Callable[[], _T], what: str, barrier: Callable[[], None] | None = None
) -> _T | None:
    """Collective: call ``function`` where ``runs_here`` holds, then raise everywhere if it raised anywhere.

    Args:
        runs_here: Whether this process does the work (e.g. ``is_main_process``).
        function: The work; called with no arguments.
        what: What the work is, for the error's note.
        barrier: Called after the work where processes are synchronised by other means than a
            ``torch.distributed`` group (e.g. XLA); errors then stay on the process that raised.

    Returns:
        ``function``'s result where it ran, ``None`` elsewhere.

    Raises:
        BaseException: ``function``'s exception, on every process.

    """
    if barrier is not None and not _distributed():
        result = function() if runs_here else None
        barrier()
        return result
    result = None
    error: BaseException | None = None
    if runs_here:
        try:
            result = function()
        except Exception as err:  # shared below; KeyboardInterrupt and SystemExit end the process as usual
            error = err
    raise_on_every_process(error, what)
    return result


_gloo_groups: dict[int, dist.ProcessGroup] = {}  # per default group (id): a gloo group for monitored barriers


def require_every_process(what: str, why: str, timeout: timedelta | None = None) -> None:
    """Collective: return once every process has called it, or raise within the process group's timeout.

    A call that must be collective (saving a sharded state, say) but comes from some processes only would otherwise
    leave them waiting in the engine's collectives for the others, which are busy elsewhere. This is
    ``torch.distributed.monitored_barrier`` (on a gloo group beside a group of another backend), which names the
    processes that did not arrive.

    Args:
        what: The call, for the error (e.g. ``"save_state"``).
        why: Why every process must make it (e.g. ``"under FSDP each process holds a shard of the state"``).
        timeout: How long to wait: the process group's (``InitProcessGroupKwargs(timeout=...)``); ``None`` is torch's
            default for the backend (30 minutes for gloo).

    Raises:
        RuntimeError: Naming the processes that did not arrive (or, on a process that arrived late, the process it
            waited for), and that every process must call ``what``.

    """
    if not _distributed():
        return
    try:
        dist.monitored_barrier(group=_barrier_group(), timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        missing = _absent_ranks(str(err))
        who = f"process(es) {missing} did not call it" if missing else f"not every process called it ({err})"
        waited = f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's timeout"
        raise RuntimeError(
            f"{what} is collective here ({why}): every process must call it, not only some (e.g. not inside"
            f" `if accelerator.is_main_process:`), but {who} within {waited}."
        ) from err


def _barrier_group() -> dist.ProcessGroup | None:
    """The default group where it is gloo's (``None``), else a gloo group over the same processes, made once."""
    default = dist.group.WORLD
    if dist.get_backend() == dist.Backend.GLOO or default is None:
        return None
    if id(default) not in _gloo_groups:
        _gloo_groups[id(default)] = dist.new_group(backend=dist.Backend.GLOO)
    return _gloo_groups[id(default)]


def _absent_ranks(message: str) -> str:
    """The ranks a monitored barrier's error names: ``"1, 3"`` (those missing, or the one a late process waited for)."""
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    if found:
        return found.group(1).strip(", ")
    late = re.search(r"waiting for send/recv from rank (\d+)", message)
    return late.group(1) if late else ""
