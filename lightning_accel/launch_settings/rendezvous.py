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
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler
from typing_extensions import override

__all__ = ["FRESH_STATIC_BACKEND", "FreshStoreStaticRendezvous", "fresh_static_backend"]

FRESH_STATIC_BACKEND = "lightning-accel-static"
_PORT_KEY = "worker_store_port"


class FreshStoreStaticRendezvous(RendezvousHandler):
    """torch's static rendezvous, with a new worker store per round.

    Args:
        static: torch's handler for the same parameters; the agents' own store (on the fixed endpoint) is its.

    """

    def __init__(self, static: StaticTCPRendezvous) -> None:
        self._static = static
        self._round = 0
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
        info = self._static.next_rendezvous()
        self._round += 1
        agents = PrefixStore(f"round_{self._round}", info.store)
        if info.rank == 0:
            self._worker_store = _new_store(self._static.master_addr, self._static.timeout)
            agents.set(_PORT_KEY, str(self._worker_store.port))
        port = int(agents.get(_PORT_KEY).decode())
        bootstrap = RendezvousStoreInfo(master_addr=self._static.master_addr, master_port=port)
        return RendezvousInfo(agents, info.rank, info.world_size, bootstrap)

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
