"""A process that Lightning's launcher started ends when the launching process (rank 0) ends.

``Trainer(devices=N)`` and ``Fabric(devices=N)`` run rank 0 in the process the user started and start ranks
``1..N-1`` as its children. Lightning watches the children (one that fails takes the others down), but nothing
watches the parent: when rank 0 ends (on a process-group timeout, an error, a kill) a child stuck outside a collective
keeps running as an orphan, holding its devices. :func:`mark_launcher` records rank 0's process id in the
environment its children inherit; :func:`watch_launcher`, in a child, starts a thread that notices the parent is
gone, says so on stderr naming both ranks, and ends the process: ``SIGTERM`` first (Lightning's handler tears the run
down), then, if the process is still alive after :data:`GRACE_S`, an immediate exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["GRACE_S", "LAUNCHER_PID_VARIABLE", "POLL_S", "mark_launcher", "watch_launcher"]

LAUNCHER_PID_VARIABLE = "LIGHTNING_ACCEL_LAUNCHER_PID"
POLL_S = 1.0  # how often a child looks at its parent
GRACE_S = 5.0  # between SIGTERM and the forced exit


def mark_launcher() -> None:
    """In the process about to start the other ranks: let its children know whom to watch."""
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())


def watch_launcher(local_rank: int) -> bool:
    """In a process Lightning's launcher started: end it once the launching process has ended.

    Args:
        local_rank: This process's rank on its machine, for the message.

    Returns:
        Whether a watch was started (``False`` outside such a child: under ``torchrun``, SLURM, or in rank 0).

    """
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE, "")
    if not launcher.isdigit() or int(launcher) == os.getpid() or os.getppid() != int(launcher):
        return False
    thread = threading.Thread(
        target=_watch, args=(int(launcher), local_rank), name="lightning-accel-launcher-watch", daemon=True
    )
    thread.start()
    return True


def _watch(launcher: int, local_rank: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    print(
        f"lightning_accel: the launching process (local rank 0, pid {launcher}) has ended, so local rank"
        f" {local_rank} (pid {os.getpid()}) ends too instead of waiting for it.",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
