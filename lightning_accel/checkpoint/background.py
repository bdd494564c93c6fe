"""Saves written in the background: staged in host memory, written by a thread, published once complete.

``save_state(async_save=True)`` copies what it saves into host memory (:func:`host_copy`: every tensor copied once per
storage, so tied weights stay tied and ``model.safetensors`` holds the same names as a synchronous save's; other
objects deep-copied) and returns; a :class:`BackgroundSave` thread then writes the files into the temporary folder
(:mod:`lightning_accel.checkpoint.folders`) and, where no other process takes part, publishes it. Training may change
the weights meanwhile: the files hold the state at the call. Where every process saves together, the folder is
published by :meth:`BackgroundSave.finish`, the collective that the next ``save_state``, ``load_state``,
``end_training`` or ``wait_for_checkpoint`` runs first. A save killed in the background leaves only the temporary
folder, which no loader lists and the next save removes.

Sharded engines stage on every process too (their gathers run in ``save_state``'s call), and their threads do file
I/O, except ``torch.distributed.checkpoint``'s planning and metadata (FSDP's sharded state dicts): those collectives
run on :func:`background_group`, a gloo group of their own, as ``torch.distributed.checkpoint.async_save`` advises, so
that they never interleave with training's collectives on the default group.

The Trainer's and Fabric's asynchronous checkpoint I/O
(:class:`~lightning_accel.strategies.checkpoint_io.AsyncNamingCheckpointIO`) writes its files through the same
:func:`host_copy` and :class:`BackgroundSave`, and queues what must wait for a save to land (removing the previous
checkpoint, renaming a rotated one) with :meth:`BackgroundSave.then`.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_accel.lightning_compat import lightning_private
from lightning_accel.state.shared_errors import raise_on_every_process

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["BackgroundSave", "HostBuffers", "background_group", "host_copy"]

_T = TypeVar("_T")
_GROUPS: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}  # id(default group) -> (it, its background group)


def background_group() -> ProcessGroup:
    """A gloo group of every process for the collectives of background saves, apart from training's.

    Its collectives wait as long as the default group's (``InitProcessGroupKwargs(timeout=...)``).

    Collective the first time under a default group (every process creates it, in the same order as its other
    groups); the same group afterwards, until the default group is destroyed and another made.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    cached = _GROUPS.get(id(default))
    if cached is None or cached[0] is not default:
        group = dist.new_group(backend="gloo", timeout=_timeout_of(default))
        cached = _GROUPS[id(default)] = (default, cast("ProcessGroup", group))
    return cached[1]


def _timeout_of(group: ProcessGroup) -> timedelta:
    """The timeout ``group``'s collectives wait for (``init_process_group(timeout=...)``), as its backend holds it.

    A group made without one waits torch's default (30 minutes for gloo), however short the default group's is.
    """
    backend = lightning_private(group, "_get_backend")(lightning_private(group, "_device_types")[0])  # type: ignore[operator,index]
    return cast("timedelta", lightning_private(backend.options, "_timeout"))


class HostBuffers:
    """Host memory that one asynchronous save's copy leaves for the next one to copy into.

    Copying into fresh memory costs more than the copy itself (the operating system maps every new page on first
    touch: on the 705 MB state of ``benchmarks/checkpoint.py``, 0.18 s against 0.07 s), so the storages of the last
    copy are reused where the next copy has a storage of the same size at the same place. The caller must know the
    previous save's files are written before copying again (``save_state`` finishes a pending save first).
    :meth:`release` gives the memory back.
    """

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []

    def copy(self, sources: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
        """A host copy of each of ``sources``, in the last copy's storages where the sizes match."""
        kept = self._storages
        copies = [
            kept[i] if i < len(kept) and kept[i].nbytes() == source.nbytes() else _host_storage(source)
            for i, source in enumerate(sources)
        ]
        for target, source in zip(copies, sources, strict=True):
            target.copy_(source)
        self._storages = copies
        return copies

    def release(self) -> None:
        """Drop the storages kept for the next copy."""
        self._storages = []


def _host_storage(like: torch.UntypedStorage) -> torch.UntypedStorage:
    pinned = like.device.type == "cuda"  # page-locked memory: the copy from the GPU runs at the bus's speed
    return torch.empty(like.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def host_copy(obj: _T, buffers: HostBuffers | None = None) -> _T:
    """``obj`` with every tensor copied into host memory, aliases kept, and every other leaf deep-copied.

    Tensors that share a storage (tied weights, views) share the copy of it, as ``torch.save`` sees storages (one
    per storage object, empty ones included), so a writer that keeps one name per storage (safetensors) writes what it
    would have written from the originals. Each copy keeps what ``torch.save`` records of its tensor besides the
    data: ``requires_grad``, being a ``Parameter``, and its Python attributes, so that the files written from the
    copies are byte for byte those written from the originals. With ``buffers``, the copy goes into the storages a
    previous copy left there (see :class:`HostBuffers`).
    """
    sources: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    tensors: list[tuple[torch.Tensor, tuple[torch.device, int]]] = []  # the originals kept alive: their ids stay

    def find_storage(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.detach().untyped_storage()
        key = (tensor.device, storage._cdata)
        sources.setdefault(key, storage)
        tensors.append((tensor, key))
        return tensor

    apply_to_collection(obj, torch.Tensor, find_storage)
    storage_copies = dict(zip(sources, (buffers or HostBuffers()).copy(list(sources.values())), strict=True))
    copies: dict[int, torch.Tensor] = {}
    for tensor, key in tensors:
        copied = torch.empty(0, dtype=tensor.dtype)
        copied.set_(storage_copies[key], tensor.storage_offset(), tensor.size(), tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        else:
            copied.requires_grad_(tensor.requires_grad)
        copies[id(tensor)] = copied
    memo: dict[int, Any] = dict(copies)
    for tensor, _ in tensors:
        if tensor.__dict__:
            copies[id(tensor)].__dict__.update(copy.deepcopy(tensor.__dict__, memo))
    return copy.deepcopy(obj, memo=memo)  # every tensor found above is taken from ``copies``


class BackgroundSave:
    """One save being written by a thread: ``write`` runs there; ``publish`` runs there too, or in :meth:`finish`.

    Args:
        write: Writes the staged files into the temporary folder.
        publish: Gives the folder its name (with its manifest).
        together: Whether every process saves into the folder, so that it is published only once all are done
            (in :meth:`finish`, a collective); else ``publish`` runs in the thread after ``write``.
        what: The folder, for errors.
        daemon: Whether the interpreter may exit without waiting for the thread (the shim waits in
            ``end_training``); ``False`` makes a script that ends without waiting still finish the write.

    """

    def __init__(
        self,
        write: Callable[[], None],
        publish: Callable[[], None],
        *,
        together: bool,
        what: str,
        daemon: bool = True,
    ) -> None:
        self._write, self._publish, self._together, self.what = write, publish, together, what
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._follow_ups: list[Callable[[], None]] = []
        self._published = False
        self._thread = threading.Thread(target=self._run, name="lightning-accel-checkpoint", daemon=daemon)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
            if not self._together:
                self._publish()
                self._run_follow_ups()
        except BaseException as error:  # raised to the caller of finish()
            self._error = error

    def _run_follow_ups(self) -> None:
        """Run the queued follow-ups, then mark the save published so that later ones run at once."""
        while True:
            with self._lock:
                if not self._follow_ups:
                    self._published = True
                    return
                action = self._follow_ups.pop(0)
            action()

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once this save is published: in the thread, or now if it already is.

        An action queued on a save that fails is dropped (what depends on the new checkpoint, such as removing the
        previous one, never runs without it); an error of an action queued earlier is raised by :meth:`finish`.

        Raises:
            BaseException: What ``action`` raised, when it runs now.

        """
        with self._lock:
            if not self._published:
                self._follow_ups.append(action)
                return
        if self._error is None:
            action()

    @property
    def together(self) -> bool:
        """Whether every process saves together (finished by a collective :meth:`finish`)."""
        return self._together

    @property
    def done(self) -> bool:
        """Whether the thread has finished (written, or failed)."""
        return not self._thread.is_alive()

    def finish(self) -> None:
        """Wait for the thread, then publish a save made together (collective then) and raise what failed.

        Raises:
            BaseException: What writing or publishing raised, on every process of a save made together.

        """
        self._thread.join()
        if self._together:
            raise_on_every_process(self._error, f"the background save of {self.what}")
            self._publish()
            self._run_follow_ups()
        elif self._error is not None:
            raise self._error
