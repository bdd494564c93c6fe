"""The shared-dictionary machinery of the states: every instance of a state class sees the same attributes.

Accelerate's states are Borg objects: each class keeps one class-level dictionary that all its instances use as their
``__dict__``, so a data loader or optimizer wrapper reads what the ``Accelerator`` recorded without a reference to it.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

__all__ = ["SharedDict", "ThreadLocalSharedDict"]

# What AcceleratorState adds to the process description PartialState shares with it.
_RUN_KEYS = ("mixed_precision",)
_PROCESS_KEYS = (
    "distributed_type",
    "device",
    "num_processes",
    "process_index",
    "local_process_index",
    "debug",
    "fork_launched",
)
# The attributes each state always has once filled in (a missing one means the state was reset).
_STATE_ATTRIBUTES = {"PartialState": _PROCESS_KEYS, "AcceleratorState": _PROCESS_KEYS + _RUN_KEYS}


class ThreadLocalSharedDict(threading.local):
    """A per-thread dictionary that reads as a class attribute (a descriptor), as Accelerate's.

    Accelerate uses it as the shared state under PyTorch/XLA's multithreaded PJRT runtime (one thread per TPU core);
    every thread then sees its own state. Modify it in place (``.clear()``): assigning a dict to the class attribute
    replaces the descriptor.
    """

    def __init__(self, thread_local: bool = False) -> None:
        del thread_local  # Accelerate's signature; the storage is always per thread
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value


SharedDict = dict
"""The dictionary type of the shared states (Accelerate picks :class:`ThreadLocalSharedDict` under XLA threads)."""


class _SharedState:
    """Instances share one attribute dictionary per class (the Borg pattern)."""

    _shared_state: ClassVar[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_shared_state" not in cls.__dict__:
            cls._shared_state = {}

    def __init__(self) -> None:
        self.__dict__ = self._shared_state

    @property
    def initialized(self) -> bool:
        """Whether the ``Accelerator`` (or the first user) filled in this state."""
        return bool(self._shared_state)

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the shared dictionary lacks: say why when the state was reset.
        if name in _STATE_ATTRIBUTES.get(type(self).__name__, ()):
            kind = type(self).__name__
            raise AttributeError(
                f"`{kind}` object has no attribute `{name}`. This happens if `{kind}._reset_state()` was called and"
                f" no `Accelerator` or `{kind}` was created since: create one before using it."
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
