"""Small validators shared by the config dataclasses.

Every check names the field, shows the offending value and says what is allowed. Wrong types raise ``TypeError``;
values of the right type outside the allowed range raise ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any


def _check_instance(name: str, value: object, kind: type, label: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, kind):
        expected = f"{label} or None" if optional else label
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """Require ``value`` to be a ``bool`` (or ``None`` when ``optional``)."""
    _check_instance(name, value, bool, "a bool", optional=optional)


def _check_int_type(name: str, value: object, requirement: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {requirement}, got {value!r} ({type(value).__name__})")
    return value


def check_positive_int(name: str, value: object, *, optional: bool = False) -> None:
    """Require an ``int`` > 0 (or ``None`` when ``optional``); ``bool`` is not an integer here."""
    if value is None and optional:
        return
    requirement = "a positive integer or None" if optional else "a positive integer"
    if _check_int_type(name, value, requirement) <= 0:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def check_non_negative_int(name: str, value: object, *, optional: bool = False) -> None:
    """Require an ``int`` >= 0 (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    requirement = "a non-negative integer or None" if optional else "a non-negative integer"
    if _check_int_type(name, value, requirement) < 0:
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    exclusive_maximum: float | None = None,
    optional: bool = False,
) -> None:
    """Require a real number (``int`` or ``float``, not ``bool``) within the given bounds."""
    if value is None and optional:
        return
    bounds = []
    if minimum is not None:
        bounds.append(f">= {minimum}")
    if exclusive_minimum is not None:
        bounds.append(f"> {exclusive_minimum}")
    if exclusive_maximum is not None:
        bounds.append(f"< {exclusive_maximum}")
    requirement = "a number" + (" " + " and ".join(bounds) if bounds else "") + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {requirement}, got {value!r} ({type(value).__name__})")
    if (
        (minimum is not None and value < minimum)
        or (exclusive_minimum is not None and value <= exclusive_minimum)
        or (exclusive_maximum is not None and value >= exclusive_maximum)
        or value != value  # NaN
    ):
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def check_choice(name: str, value: object, allowed: Iterable[Any]) -> None:
    """Require ``value`` to be one of ``allowed`` (compared with ``==``)."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_str(name: str, value: object, *, optional: bool = False) -> None:
    """Require a ``str`` (or ``None`` when ``optional``)."""
    _check_instance(name, value, str, "a string", optional=optional)


def check_callable(name: str, value: object, *, optional: bool = True) -> None:
    """Require a callable (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if not callable(value):
        expected = "a callable or None" if optional else "a callable"
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_str_list(name: str, value: object, *, optional: bool = True) -> None:
    """Require a list of strings (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        expected = "a list of strings or None" if optional else "a list of strings"
        raise TypeError(f"{name} must be {expected}, got {value!r}")


def normalize_enum_name(name: str, value: object, names: Sequence[str]) -> str:
    """Map a torch-style enum spelling onto one of ``names`` (upper-case, 1-based like torch's enums).

    Accepted spellings: the name in any case (``"full_shard"``), its 1-based position as an ``int`` or a digit string
    (``1``, ``"1"``), or an enum member whose name (leading underscores ignored) is in ``names``. This lets a plain
    string, an older Accelerate config's integer, or the torch enum itself be passed without importing torch's
    FSDP modules here.
    """
    if isinstance(value, enum.Enum):
        candidate = value.name.lstrip("_").upper()
    elif isinstance(value, bool):
        candidate = ""
    elif isinstance(value, int):
        candidate = names[value - 1] if 1 <= value <= len(names) else ""
    elif isinstance(value, str):
        candidate = value.strip().upper()
        if candidate.isdigit():
            index = int(candidate)
            candidate = names[index - 1] if 1 <= index <= len(names) else ""
    else:
        raise TypeError(f"{name} must be a string, an int or a torch enum member, got {value!r}")
    if candidate not in names:
        raise ValueError(f"{name} must be one of {list(names)} (or its 1-based index), got {value!r}")
    return candidate


def fill_none_with_defaults(obj: Any, names: Iterable[str]) -> None:
    """Replace ``None`` in the named dataclass fields of ``obj`` by the fields' declared defaults.

    Accelerate treats ``None`` in these fields as "not set" (and then reads an environment variable); here ``None``
    simply means the plain default, so ``Plugin(field=None)`` and ``Plugin()`` agree.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    for name in names:
        if getattr(obj, name) is None:
            setattr(obj, name, defaults[name])
