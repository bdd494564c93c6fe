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
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_accel.state.shared_errors import raise_on_every_process

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["BackgroundSave", "background_group", "host_copy"]

_T = TypeVar("_T")
_GROUPS: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}  # id(default group) -> (it, its background group)


def background_group() -> ProcessGroup:
    """A gloo group of every process for the collectives of background saves, apart from training's.

    Collective the first time under a default group (every process creates it, in the same order as its other
    groups); the same group afterwards, until the default group is destroyed and another made.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    cached = _GROUPS.get(id(default))
    if cached is None or cached[0] is not default:
        cached = _GROUPS[id(default)] = (default, cast("ProcessGroup", dist.new_group(backend="gloo")))
    return cached[1]


def host_copy(obj: _T) -> _T:
    """``obj`` with every tensor copied into host memory, aliases kept, and every other leaf deep-copied.

    Tensors that share a storage (tied weights, views) share the copy of it, as ``torch.save`` sees storages (one
    per storage object, empty ones included), so a writer that keeps one name per storage (safetensors) writes what it
    would have written from the originals. Each copy keeps what ``torch.save`` records of its tensor besides the
    data: ``requires_grad``, being a ``Parameter``, and its Python attributes, so that the files written from the
    copies are byte for byte those written from the originals.
    """
    storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    originals: list[torch.Tensor] = []  # kept alive, so that their ids stay theirs until the copy is done
    copies: dict[int, torch.Tensor] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        detached = tensor.detach()
        source = detached.untyped_storage()
        key = (detached.device, source._cdata)
        if key not in storages:
            storages[key] = source.cpu() if detached.device.type != "cpu" else source.clone()
        copied = torch.empty(0, dtype=detached.dtype)
        copied.set_(storages[key], detached.storage_offset(), detached.size(), detached.stride())
        if isinstance(tensor, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        else:
            copied.requires_grad_(tensor.requires_grad)
        originals.append(tensor)
        copies[id(tensor)] = copied
        return tensor

    apply_to_collection(obj, torch.Tensor, copy_tensor)
    memo: dict[int, Any] = dict(copies)
    for tensor in originals:
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

    """

    def __init__(self, write: Callable[[], None], publish: Callable[[], None], *, together: bool, what: str) -> None:
        self._write, self._publish, self._together, self.what = write, publish, together, what
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lightning-accel-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
            if not self._together:
                self._publish()
        except BaseException as error:  # raised to the caller of finish()
            self._error = error

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
        elif self._error is not None:
            raise self._error
