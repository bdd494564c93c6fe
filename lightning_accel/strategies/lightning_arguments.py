"""The arguments Lightning's strategies take besides a backend's settings, declared once for every ``acc_*`` strategy.

Each ``acc_*`` strategy takes its backend's settings (``fsdp_plugin``, ``ddp_kwargs``, ...) and Lightning's own
arguments as ``**kwargs: Unpack[...]`` of a ``TypedDict`` (PEP 692): type checkers, IDEs and ``LightningCLI`` see
every name and type, and the Trainer and Fabric twins of a backend share one declaration of its settings.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.pytorch.accelerators import Accelerator as TrainerAccelerator
from lightning.pytorch.plugins import Precision as TrainerPrecision
from typing_extensions import Unpack

__all__ = [
    "FabricPlugins",
    "ParallelArguments",
    "StartMethod",
    "TrainerPlugins",
    "check_keywords",
    "declared_keywords",
    "keyword_names",
    "takes_any_keyword",
]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ParallelArguments(TypedDict, total=False):
    """The devices of a multi-process strategy (the Trainer or Fabric sets them when left out)."""

    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None


class TrainerPlugins(TypedDict, total=False):
    """A Trainer strategy's accelerator and precision plugin (the Trainer sets them when left out)."""

    accelerator: TrainerAccelerator | None
    precision_plugin: TrainerPrecision | None


class FabricPlugins(TypedDict, total=False):
    """A Fabric strategy's accelerator and precision plugin (Fabric sets them when left out)."""

    accelerator: FabricAccelerator | None
    precision: FabricPrecision | None


def check_keywords(owner: object, given: Mapping[str, Any]) -> None:
    """Refuse a keyword that ``type(owner)``'s constructor does not declare, as Python refuses an unknown argument.

    Raises:
        TypeError: Naming the keyword and those ``type(owner)`` takes.

    """
    cls: type = type(owner)
    known = declared_keywords(cls)
    for key in given:
        if key not in known:
            raise TypeError(
                f"{cls.__name__}() got an unexpected keyword argument {key!r}; it takes {', '.join(sorted(known))}."
            )


@functools.cache
def declared_keywords(cls: type) -> frozenset[str]:
    """The keys of the ``**kwargs: Unpack[...]`` of the nearest ``__init__`` in ``cls``'s MRO that declares one.

    A subclass whose ``__init__`` takes plain ``**kwargs`` passes them on to that constructor.

    Raises:
        TypeError: If no class in the MRO declares one.

    """
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        schema = None if init is None else _unpacked(init)
        if schema is not None:
            return _keys(schema)
    raise TypeError(f"No __init__ of {cls.__name__} declares its keywords as **kwargs: Unpack[...].")


def keyword_names(cls: type) -> frozenset[str]:
    """The keyword arguments ``cls(...)`` names, those of a ``**kwargs: Unpack[...]`` included."""
    named = frozenset(p.name for p in _parameters(cls) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    schema = _unpacked(cls.__init__)  # type: ignore[misc]  # a class's own __init__
    return named if schema is None else named | _keys(schema)


def takes_any_keyword(cls: type) -> bool:
    """Whether ``cls(...)`` takes keywords it does not name (an untyped ``**kwargs``)."""
    return any(p.kind is p.VAR_KEYWORD for p in _parameters(cls)) and _unpacked(cls.__init__) is None  # type: ignore[misc]


def _parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


def _unpacked(init: Callable[..., Any]) -> type | None:
    """The ``TypedDict`` of a constructor's ``**kwargs: Unpack[...]``, if it has one."""
    variadic = next((p.name for p in _parameters(init) if p.kind is p.VAR_KEYWORD), None)
    if variadic is None:
        return None
    hint = typing.get_type_hints(init).get(variadic)
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Unpack else None


def _keys(schema: type) -> frozenset[str]:
    """The keys a ``TypedDict`` declares (its bases' included)."""
    return frozenset(schema.__required_keys__ | schema.__optional_keys__)  # type: ignore[attr-defined]
