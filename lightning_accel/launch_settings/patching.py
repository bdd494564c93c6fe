"""Accelerate's helpers that change ``os.environ`` for a block of code and put it back afterwards."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["clear_environment", "patch_environment", "purge_accelerate_environment"]

_T = TypeVar("_T")
_PREFIX = "ACCELERATE_"
_PURGED = "_lightning_accel_purged_environment"


@contextmanager
def _restored(keys: Callable[[], Iterator[str]]) -> Generator[None, None, None]:
    """Snapshot the variables ``keys()`` names; afterwards restore them and drop the ones that were added."""
    before = {key: os.environ[key] for key in keys()}
    try:
        yield
    finally:
        for key in list(keys()):
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


@contextmanager
def clear_environment() -> Generator[None, None, None]:
    """Run the body with an empty ``os.environ``; the whole previous environment comes back afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def patch_environment(**variables: Any) -> Generator[None, None, None]:
    """Set each keyword as an environment variable (name upper-cased, value ``str()``-ed) for the body.

    Variables that existed get their old value back afterwards; the others are removed.
    """
    names = {name.upper(): str(value) for name, value in variables.items()}
    with _restored(lambda: (key for key in names if key in os.environ)):
        os.environ.update(names)
        yield


def _accelerate_variables() -> Iterator[str]:
    return (key for key in os.environ if key.startswith(_PREFIX))


def _purging(function: Callable[..., _T]) -> Callable[..., _T]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        with _restored(_accelerate_variables):
            return function(*args, **kwargs)

    setattr(wrapper, _PURGED, True)
    return wrapper


def _purge_test_methods(cls: type) -> None:
    for name in dir(cls):
        method = getattr(cls, name)
        if name.startswith("test") and callable(method) and not getattr(method, _PURGED, False):
            setattr(cls, name, _purging(method))


def purge_accelerate_environment(func_or_cls: _T) -> _T:
    """Undo every ``ACCELERATE_*`` variable a function (or each ``test*`` method of a class) sets or changes.

    Decorating a class also covers its subclasses' test methods, so a base test class can carry it.
    """
    if not isinstance(func_or_cls, type):
        return _purging(func_or_cls)  # type: ignore[arg-type,return-value]  # any callable
    cls: type = func_or_cls
    _purge_test_methods(cls)
    previous = cls.__dict__.get("__init_subclass__")

    def init_subclass(subclass: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(subclass, **kwargs)
        else:
            super(cls, subclass).__init_subclass__(**kwargs)  # type: ignore[arg-type]  # mypy misreads super(type, type)
        _purge_test_methods(subclass)

    cls.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment,method-assign]
    return func_or_cls
