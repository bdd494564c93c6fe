"""A read-only attribute computed at each read, for answers that follow other state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from typing_extensions import Self

__all__ = ["DerivedAttribute"]

_T = TypeVar("_T")


class DerivedAttribute(Generic[_T]):
    """A class attribute whose value is ``derive(instance, name)``, computed at each read; setting it fails.

    Args:
        derive: Computes the value from the instance and the attribute's name.

    """

    def __init__(self, derive: Callable[[Any, str], _T]) -> None:
        self._derive = derive
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Self: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object, owner: type | None = None) -> Self | _T:
        if instance is None:
            return self
        return self._derive(instance, self._name)

    def __set__(self, instance: object, value: _T) -> None:
        raise AttributeError(f"{type(instance).__name__}.{self._name} is derived from other state and read-only")
