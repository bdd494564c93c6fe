"""Replace a method on one object (never on its class) and put back exactly what was there."""

from __future__ import annotations

from typing import Any

from lightning_accel.lightning_compat import lightning_private

_MISSING = object()


class InstancePatch:
    """An attribute of one object replaced for a while, e.g. a trainer's loop method during one ``fit``.

    The replacement is stored in the object's ``__dict__``, so it shadows the class attribute for that object only;
    other trainers, strategies and loops are untouched.

    Args:
        target: The object to patch.
        name: The attribute to replace.
        replacement: The new value (usually a function closing over the original bound method).

    Raises:
        RuntimeError: If ``name`` is private (``_...``) and ``target`` lacks it: the Lightning version changed it.

    """

    def __init__(self, target: object, name: str, replacement: Any) -> None:
        if name.startswith("_"):
            lightning_private(target, name)  # a private member Lightning may rename: fail clearly if it did
        self._target = target
        self._name = name
        self._replacement = replacement
        self._previous = vars(target).get(name, _MISSING)
        setattr(target, name, replacement)

    def restore(self) -> None:
        """Put back the instance attribute that was there before (or remove ours to reveal the class attribute).

        Raises:
            RuntimeError: If someone else replaced the attribute after us: restoring would silently drop their patch.

        """
        current = vars(self._target).get(self._name, _MISSING)
        if current is not self._replacement:
            raise RuntimeError(
                f"{type(self._target).__name__}.{self._name} was replaced again after lightning_accel patched it;"
                " undo the later patch first (patches must be undone in reverse order)."
            )
        if self._previous is _MISSING:
            delattr(self._target, self._name)
        else:
            setattr(self._target, self._name, self._previous)
