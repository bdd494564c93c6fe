"""A static rendezvous whose every round gives the workers a new store, so a restart never reads a dead attempt's keys.

torch's ``static`` rendezvous (a fixed ``--master_port``, or several machines with ``rdzv_backend: static``) creates
one TCP store on the rank-0 machine and hands it to the workers of every attempt. After a worker dies and the elastic
agent restarts the group, the keys the last attempt's process group wrote (each rank's gloo/NCCL address) are still
there, and a restarted rank can read a dead rank's address before the new one overwrites it: the mesh then fails
with ``connectFullMesh failed ... Connection refused``. torch relies on a fresh store per attempt for this
(``torch.distributed.rendezvous._create_c10d_store`` adds no per-attempt prefix), which its ``c10d`` rendezvous gives
and ``static`` does not.

:data:`FRESH_STATIC_BACKEND` is ``static`` with that fixed: the agents still meet on the fixed endpoint, and each
round the rank-0 agent starts a new store on a free port for the workers and tells the other agents its port through
a per-round key. :func:`fresh_static_backend` registers it with torch's rendezvous registry and returns its name.

Each round also waits for every machine to arrive (a key per machine rank in the agents' store) until the rendezvous
``timeout`` (``--rdzv_conf timeout=N``, what ``rdzv_timeout`` sets). torch's handler waits silently and then fails
with a store error (``1/2 clients joined`` on the rank-0 machine, a socket timeout on the others); here every waiting
machine says after a few seconds whom it waits for, and at the timeout raises a ``RendezvousTimeoutError`` naming how
many machines arrived, the missing machine ranks and the address.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistError, PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler
from typing_extensions import override

__all__ = [
    "FRESH_STATIC_BACKEND",
    "FreshStoreStaticRendezvous",
    "Meeting",
    "fresh_static_backend",
    "wait_for_machines",
]

FRESH_STATIC_BACKEND = "lightning-accel-static"
_PORT_KEY = "worker_store_port"
_ARRIVED_KEY = "arrived_machine_{}"
NOTICE_AFTER_S = 5.0  # a machine still waiting after this long says whom it waits for
_POLL_S = 0.25
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Meeting:
    """The machines of one rendezvous, as this machine sees them.

    Attributes:
        rank: This machine's rank (``machine_rank``).
        machines: Machines taking part (``num_machines``).
        host: The rank-0 machine's address.
        port: The port the agents meet on.
        timeout: How long a round may wait for every machine.

    """

    rank: int
    machines: int
    host: str
    port: int
    timeout: timedelta

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def waiting(self, missing: list[int]) -> str:
        """The note a machine logs while it waits."""
        return (
            f"machine_rank {self.rank}: waiting up to {self.timeout.total_seconds():g} s at {self.address} for "
            f"machine_rank(s) {_ranks(missing)} ({self.machines - len(missing)} of {self.machines} machines here)"
        )

    def timed_out(self, missing: list[int], unseen: bool = False) -> RendezvousTimeoutError:
        """The error of a round that ran out of time with ``missing`` absent.

        Args:
            missing: The machine ranks that did not arrive.
            unseen: Whether this machine never reached the rank-0 machine (then it cannot see the others).

        """
        arrived = self.machines - len(missing)
        count = f"1 of {self.machines} machines (this one)" if unseen else f"{arrived} of {self.machines} machines"
        unknown = " (the main machine; without it the other machines cannot be seen)" if unseen else ""
        return RendezvousTimeoutError(
            f"machine_rank {self.rank}: only {count} arrived at the rendezvous on {self.address} within "
            f"rdzv_timeout {self.timeout.total_seconds():g} s; missing machine_rank(s): {_ranks(missing)}{unknown}. "
            f"Start `lightning-accel launch --num_machines {self.machines} --machine_rank R --main_process_ip "
            f"{self.host} --main_process_port {self.port} ...` on each missing machine (and check that {self.address} "
            "is reachable from it), or raise --rdzv_timeout if machines start late"
        )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


class FreshStoreStaticRendezvous(RendezvousHandler):
    """torch's static rendezvous, with a new worker store per round.

    Args:
        static: torch's handler for the same parameters; the agents' own store (on the fixed endpoint) is its.

    """

    def __init__(self, static: StaticTCPRendezvous) -> None:
        self._static = static
        self._round = 0
        self._agent_store: TCPStore | None = None
        self._worker_store: TCPStore | None = None

    @override
    def get_backend(self) -> str:
        return FRESH_STATIC_BACKEND

    @property
    @override
    def use_agent_store(self) -> bool:
        return True  # the workers are clients of the round's store, which the rank-0 agent hosts

    @override
    def next_rendezvous(self) -> RendezvousInfo:
        static = self._static
        meeting = Meeting(static.rank, static.world_size, static.master_addr, static.master_port, static.timeout)
        deadline = time.monotonic() + meeting.timeout.total_seconds()
        if self._agent_store is None:
            self._agent_store = _agent_store(meeting, deadline)
        self._round += 1
        agents = PrefixStore(f"round_{self._round}", PrefixStore(static.run_id, self._agent_store))
        wait_for_machines(agents, meeting, deadline)
        if meeting.rank == 0:
            self._worker_store = _new_store(static.master_addr, static.timeout)
            agents.set(_PORT_KEY, str(self._worker_store.port))
        port = int(agents.get(_PORT_KEY).decode())
        bootstrap = RendezvousStoreInfo(master_addr=static.master_addr, master_port=port)
        return RendezvousInfo(agents, meeting.rank, meeting.machines, bootstrap)

    @override
    def is_closed(self) -> bool:
        return self._static.is_closed()

    @override
    def set_closed(self) -> None:
        self._static.set_closed()

    @override
    def num_nodes_waiting(self) -> int:
        return self._static.num_nodes_waiting()

    @override
    def get_run_id(self) -> str:
        return self._static.get_run_id()

    @override
    def shutdown(self) -> bool:
        return self._static.shutdown()


def _agent_store(meeting: Meeting, deadline: float) -> TCPStore:
    """The agents' store on the fixed endpoint: hosted by the rank-0 machine, reached by the others until ``deadline``.

    Raises:
        RendezvousTimeoutError: If the rank-0 machine does not answer in time (naming it and the address).

    """
    if meeting.rank == 0:  # the others are counted by wait_for_machines, not by the store's client count
        return TCPStore(
            meeting.host,
            meeting.port,
            is_master=True,
            timeout=meeting.timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
    # Waiting in TCPStore's own connect would log a C++ error with a stack per attempt: wait for the port quietly.
    _poll(lambda: _port_open(meeting.host, meeting.port), meeting, deadline, lambda: [0], unseen=True)
    return TCPStore(meeting.host, meeting.port, is_master=False, timeout=meeting.timeout)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=_POLL_S):
            return True
    except OSError:
        return False


def wait_for_machines(agents: Store, meeting: Meeting, deadline: float) -> None:
    """Record this machine's arrival in ``agents`` and wait for every machine's until ``deadline``.

    Raises:
        RendezvousTimeoutError: If some machine ranks have not arrived by then (naming them).

    """
    agents.set(_ARRIVED_KEY.format(meeting.rank), "1")
    keys = [_ARRIVED_KEY.format(rank) for rank in range(meeting.machines)]
    _poll(lambda: agents.check(keys), meeting, deadline, lambda: _missing(agents, keys))


def _poll(
    done: Callable[[], bool],
    meeting: Meeting,
    deadline: float,
    missing: Callable[[], list[int]],
    unseen: bool = False,
) -> None:
    """Wait until ``done()``: a note after :data:`NOTICE_AFTER_S`, the timeout error at ``deadline``."""
    notice_at = time.monotonic() + NOTICE_AFTER_S
    while not done():
        now = time.monotonic()
        if now >= deadline:
            raise meeting.timed_out(missing(), unseen=unseen)
        if now >= notice_at:
            _log.warning(meeting.waiting(missing()))
            notice_at = float("inf")
        time.sleep(_POLL_S)


def _missing(agents: Store, keys: list[str]) -> list[int]:
    """The machine ranks whose arrival key is absent (rank 0 alone when the store itself is gone)."""
    try:
        return [rank for rank, key in enumerate(keys) if not agents.check([key])]
    except DistError:  # the rank-0 machine, which hosts the store, went away (it timed out first)
        return [0]


def _new_store(host: str, timeout: timedelta) -> TCPStore:
    """A store server on a free port of this machine (the workers connect to it as clients)."""
    return TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False, multi_tenant=True)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    static = create_rdzv_handler(params)  # torch's checks of rank and endpoint, and its handler
    assert isinstance(static, StaticTCPRendezvous)
    return FreshStoreStaticRendezvous(static)


def fresh_static_backend() -> str:
    """Register :class:`FreshStoreStaticRendezvous` with torch's elastic launcher (idempotent); return its name."""
    rendezvous_handler_registry.register(FRESH_STATIC_BACKEND, _create)
    return FRESH_STATIC_BACKEND
