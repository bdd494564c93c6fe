"""Make a checkpoint folder complete on every node's own disk (``save_on_each_node`` with node-local storage).

Sharded engines write one file per process (``torch.distributed.checkpoint`` shards, DeepSpeed's partitions) and a
few on the main process only (DCP's ``.metadata``, ``meta.pt``, ``latest``). On node-local disks each node then holds
only its own processes' part of the checkpoint, which neither loads nor can be copied elsewhere.
:func:`complete_on_each_node` fixes that after the save: each node's local main process lists what its disk holds,
every process derives the same plan from the listings, and each file a node lacks is sent to it by the lowest rank
that has it, over the default process group, in chunks (memory stays bounded by one chunk). A received file is written
under a temporary name beside its place and renamed once whole.

Nothing is copied where the listings agree: on one node, or where every node sees the same (shared) folder. That is
read from the listings, not assumed.

Failures do not hang the other processes: the transfer schedule is fixed by the plan before any byte moves, a process
that cannot read or write keeps its part of the schedule (sending zeros, discarding what it receives), and the first
error is raised on every process at the end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist

from lightning_accel.state.shared_errors import raise_on_every_process

__all__ = ["CHUNK_BYTES", "FileCopy", "complete_on_each_node", "list_files", "plan_copies"]

CHUNK_BYTES = 64 * 1024 * 1024
"""How many bytes of a file travel in one message (and are held in memory at once)."""

_RECEIVING = ".receiving"

Listing = Mapping[str, int]
"""A node's files: path relative to the folder (POSIX separators) -> size in bytes."""


@dataclass(frozen=True)
class FileCopy:
    """One file to send: from the ``source`` rank to the local main processes ``destinations`` that lack it."""

    path: str
    size: int
    source: int
    destinations: tuple[int, ...]


def list_files(folder: Path) -> dict[str, int]:
    """The regular files under ``folder`` (not following symbolic links) with their sizes; ``{}`` if not a folder.

    Args:
        folder: The folder to list.

    Returns:
        Relative POSIX path -> size in bytes.

    """
    found: dict[str, int] = {}
    if not folder.is_dir() or folder.is_symlink():
        return found
    for directory, _, names in os.walk(folder):
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink() and not name.endswith(_RECEIVING):
                found[path.relative_to(folder).as_posix()] = path.stat().st_size
    return found


def plan_copies(listings: Sequence[Listing | None]) -> list[FileCopy]:
    """Which files go from where to where, given each rank's listing (``None`` on ranks that are no node's manager).

    A file is sent to every listing rank that lacks it, from the lowest rank that has it (with that rank's size).

    Args:
        listings: Indexed by global rank.

    Returns:
        The copies in a deterministic order (by path), the same on every process given the same listings.

    """
    managers = [(rank, listing) for rank, listing in enumerate(listings) if listing is not None]
    every_path = sorted({path for _, listing in managers for path in listing})
    plan = []
    for path in every_path:
        having = [(rank, listing[path]) for rank, listing in managers if path in listing]
        lacking = tuple(rank for rank, listing in managers if path not in listing)
        if lacking:
            source, size = having[0]
            plan.append(FileCopy(path, size, source, lacking))
    return plan


def complete_on_each_node(
    folder: Path, *, node_manager: bool, what: str = "save_on_each_node", chunk_bytes: int = CHUNK_BYTES
) -> list[FileCopy]:
    """Collective: give every node's copy of ``folder`` each file that another node's copy has.

    Every process calls it after the save has finished writing (behind a barrier), with ``node_manager`` true on
    each node's local main process. Without a process group of more than one process it does nothing.

    Args:
        folder: The checkpoint folder, as this node's processes see it (usually a temporary one, published after).
        node_manager: Whether this process lists and receives for its node (local rank 0).
        what: What is being saved, for the note of a shared error.
        chunk_bytes: Bytes per message.

    Returns:
        The copies made (the same list on every process); empty on shared storage and on one node.

    Raises:
        OSError: A listing, reading or writing error of any process, on every process (the lowest rank's).
        RuntimeError: If a file changed size while it was sent, on every process.

    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return []
    error: BaseException | None = None
    listing: dict[str, int] | None = None
    if node_manager:
        try:
            listing = list_files(folder)
        except OSError as err:
            error = err
    raise_on_every_process(error, f"{what} (listing the checkpoint on each node)")
    listings: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(listings, listing)
    plan = plan_copies(listings)
    error = _transfer(folder, plan, dist.get_rank(), chunk_bytes)
    raise_on_every_process(error, f"{what} (copying checkpoint files between nodes)")
    return plan


def _transfer(folder: Path, plan: Sequence[FileCopy], rank: int, chunk_bytes: int) -> BaseException | None:
    """Do this process's part of every copy of ``plan``; return its first error instead of leaving the schedule."""
    device = _device()
    error: BaseException | None = None
    for copy in plan:
        outcome = None
        if copy.source == rank:
            outcome = _send(folder, copy, chunk_bytes, device)
        elif rank in copy.destinations:
            outcome = _receive(folder, copy, chunk_bytes, device)
        error = error or outcome  # every part is done; the first error is the one reported
    return error


def _chunks(size: int, chunk_bytes: int) -> list[int]:
    return [min(chunk_bytes, size - start) for start in range(0, size, chunk_bytes)]


def _send(folder: Path, copy: FileCopy, chunk_bytes: int, device: torch.device) -> BaseException | None:
    error: BaseException | None = None
    handle = None
    try:
        handle = (folder / copy.path).open("rb")
    except OSError as err:
        error = err
    try:
        for length in _chunks(copy.size, chunk_bytes):
            data, error = _read_chunk(folder / copy.path, handle, length, error)
            buffer = torch.zeros(length, dtype=torch.uint8) if error is not None else _bytes_tensor(data)
            buffer = buffer.to(device)
            for destination in copy.destinations:
                dist.send(buffer, dst=destination)
        if error is None and handle is not None and _has_more(handle):
            error = RuntimeError(f"{folder / copy.path} grew while it was sent to the other nodes.")
    except OSError as err:
        error = err
    finally:
        if handle is not None:
            handle.close()
    status = torch.tensor([0 if error is None else 1], dtype=torch.uint8).to(device)
    for destination in copy.destinations:
        dist.send(status, dst=destination)  # a receiver keeps the file only if it arrived whole
    return error


def _read_chunk(
    path: Path, handle: BinaryIO | None, length: int, error: BaseException | None
) -> tuple[bytes, BaseException | None]:
    """The next ``length`` bytes of ``path`` and the error so far (nothing is read once there is one)."""
    if error is not None or handle is None:
        return b"", error
    try:
        data = handle.read(length)
    except OSError as err:
        return b"", err
    if len(data) != length:
        return data, RuntimeError(f"{path} shrank while it was sent to the other nodes.")
    return data, None


def _has_more(handle: BinaryIO) -> bool:
    return bool(handle.read(1))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _receive(folder: Path, copy: FileCopy, chunk_bytes: int, device: torch.device) -> BaseException | None:
    """Receive ``copy`` into ``.<name>.<rank>.receiving`` beside its place, then rename it into place.

    A file whose sender failed (it says so after the last chunk) is discarded; the sender reports its own error.
    """
    final = folder / copy.path
    partial = final.with_name(f".{final.name}.{dist.get_rank()}{_RECEIVING}")
    error: BaseException | None = None
    sent_whole = False
    handle = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        handle = partial.open("wb")
    except OSError as err:
        error = err
    try:
        for length in _chunks(copy.size, chunk_bytes):
            buffer = torch.empty(length, dtype=torch.uint8, device=device)
            dist.recv(buffer, src=copy.source)
            if error is None and handle is not None:
                try:
                    handle.write(buffer.cpu().numpy().tobytes())
                except OSError as err:
                    error = err
        status = torch.empty(1, dtype=torch.uint8, device=device)
        dist.recv(status, src=copy.source)
        sent_whole = int(status.item()) == 0
        if error is None and handle is not None:
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        error = err
    finally:
        if handle is not None:
            handle.close()
    try:
        if error is None and sent_whole:
            os.replace(partial, final)
        else:
            partial.unlink(missing_ok=True)
    except OSError as err:
        error = error or err
    return error


def _device() -> torch.device:
    """Where the default process group's point-to-point messages live: CUDA for NCCL alone, else the CPU."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and "cpu:" not in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
