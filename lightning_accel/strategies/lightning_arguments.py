"""The signature of a strategy whose family adapter passes ``**lightning_arguments`` on to Lightning's strategy.

A family adapter (``DDPFamilyAdapter``, ...) owns the one constructor of its Trainer and Fabric twins: it takes the
family's arguments by name and hands the rest to the Lightning strategy class the twin extends. What a twin accepts is
therefore the adapter's arguments plus that Lightning class's own; :class:`LightningArguments` says so to
``inspect.signature`` (the shim and the settings read it to know which options a strategy takes), and
:func:`check_lightning_arguments` refuses any other keyword, as an explicit signature would.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

__all__ = ["LightningArguments", "check_lightning_arguments"]

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class LightningArguments:
    """``__signature__`` of the classes built on a family adapter: its arguments, then the Lightning strategy's.

    Set it as the adapter's ``__signature__``. For a class whose constructor chain reaches the adapter through
    ``**`` arguments (a twin's own ``__init__`` may add a few), the signature is the named parameters along that
    chain followed, keyword-only, by the ``offered`` ones of the first Lightning class in the MRO; other classes keep
    the signature Python computes.

    Args:
        offered: The parameters of Lightning's strategy classes the family passes on (``precision_plugin`` is the
            Trainer's, ``precision`` Fabric's: each twin gets those its Lightning class has).

    """

    def __init__(self, *offered: str) -> None:
        self.offered = frozenset(offered)
        self._adapter: type | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        self._adapter = owner

    def __get__(self, instance: object, owner: type | None = None) -> inspect.Signature | None:
        cls = owner if owner is not None else type(instance)
        own = self._chain_parameters(cls)
        if own is None:
            return None
        taken = {parameter.name for parameter in own}
        lightning = [
            parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for parameter in _named_parameters(_lightning_class(cls))
            if parameter.name in self.offered and parameter.name not in taken
        ]
        return inspect.Signature([*own, *lightning])

    def _chain_parameters(self, cls: type) -> list[inspect.Parameter] | None:
        """The named parameters of the ``__init__`` chain from ``cls`` to the adapter (``None`` if it stops before)."""
        parameters: dict[str, inspect.Parameter] = {}
        for klass in cls.__mro__:
            init = vars(klass).get("__init__")
            if init is None:
                continue
            for parameter in _named_parameters(klass):
                parameters.setdefault(parameter.name, parameter)
            if klass is self._adapter:
                return sorted(parameters.values(), key=lambda parameter: parameter.kind)
            if not _forwards_keywords(init):
                return None
        return None


def check_lightning_arguments(strategy: object, arguments: Mapping[str, Any]) -> None:
    """Refuse the keywords ``strategy``'s signature lacks (Lightning's arguments its family does not pass on).

    Raises:
        TypeError: Naming the unexpected keywords, as Python does for an explicit signature.

    """
    accepted = inspect.signature(type(strategy)).parameters
    unexpected = sorted(name for name in arguments if name not in accepted)
    if unexpected:
        raise TypeError(f"{type(strategy).__name__}() got unexpected keyword arguments: {', '.join(unexpected)}")


def _named_parameters(cls: type) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[1:]  # without self
    return [parameter for parameter in parameters if parameter.kind in _NAMED]


def _forwards_keywords(init: Any) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(init).parameters.values())


def _lightning_class(cls: type) -> type:
    return next(k for k in cls.__mro__ if k.__module__.startswith("lightning.") and "__init__" in vars(k))
