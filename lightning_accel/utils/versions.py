"""Accelerate's version comparisons (``accelerate.utils.versions``): a library's or torch's version against a bound."""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Callable

from packaging.version import Version, parse

__all__ = ["STR_OPERATION_TO_FUNC", "compare_versions", "is_torch_version", "torch_version"]

STR_OPERATION_TO_FUNC: dict[str, Callable[[Version, Version], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}

# The installed torch, as its distribution metadata gives it (local labels such as ``+cpu`` included, as Accelerate).
torch_version: Version = parse(importlib.metadata.version("torch"))


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Compare a version with ``requirement_version``: ``compare_versions("numpy", ">=", "1.25")``.

    Args:
        library_or_version: A version, or the name of an installed distribution whose version is compared.
        operation: One of ``>``, ``>=``, ``==``, ``!=``, ``<=``, ``<``.
        requirement_version: The version to compare against.

    Raises:
        ValueError: For an unknown ``operation``.
        importlib.metadata.PackageNotFoundError: If ``library_or_version`` names a distribution that is not installed.

    """
    if operation not in STR_OPERATION_TO_FUNC:
        raise ValueError(
            f"`operation` must be one of {list(STR_OPERATION_TO_FUNC)}, received {operation!r}; "
            "pass one of those comparison strings"
        )
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return STR_OPERATION_TO_FUNC[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch with ``version``: ``is_torch_version(">=", "2.4")``.

    Raises:
        ValueError: For an unknown ``operation``.

    """
    return compare_versions(torch_version, operation, version)
