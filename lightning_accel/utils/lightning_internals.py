"""Lightning's private members, used with a check: a Lightning release that renamed one fails with a clear error.

lightning_accel reads, writes or overrides a few private members of Lightning objects (a loop's
``_should_accumulate``, the trainer's ``_checkpoint_connector``, a strategy's ``_configure_launcher``, ...). They are
not part of Lightning's API and may change in any release. Used directly, a renamed one is a bare ``AttributeError``
deep inside a run, or worse, nothing at all: a write creates an attribute Lightning no longer reads, and an override
of a renamed method is never called. So every use goes through this module, which turns either into an error naming
the member and the installed Lightning version:

- :func:`lightning_private` reads an attribute of a Lightning object, :func:`set_lightning_private` writes one that
  must already exist;
- :func:`lightning_private_members` decorates a class that overrides or calls private methods (or class attributes)
  of its Lightning base classes, and checks at class definition, i.e. when lightning_accel is imported, that a
  Lightning base still defines each of them.

Private *imports* (``from lightning.fabric.wrappers import _FabricModule``) are left as imports: they fail at once,
when lightning_accel is imported, with an ``ImportError`` naming the module and the member. ``tests/
test_lightning_internals.py`` fails on a private Lightning member used any other way.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch.nn import Module

__all__ = [
    "LIGHTNING_PRIVATES_ATTRIBUTE",
    "declared_lightning_privates",
    "fabric_forward_module",
    "lightning_private",
    "lightning_private_members",
    "missing_private_error",
    "set_lightning_private",
]

_Class = TypeVar("_Class", bound=type)

# Where lightning_private_members records, on the decorated class itself, the names it declared.
LIGHTNING_PRIVATES_ATTRIBUTE = "__lightning_privates__"


def _lightning_version() -> str:
    import lightning

    return str(lightning.__version__)


def missing_private_error(target: object, name: str) -> RuntimeError:
    """The error for a private Lightning member that this Lightning version lacks.

    Args:
        target: The Lightning object (or class, or module) that should have the member.
        name: The member's name.

    """
    owner = target.__name__ if isinstance(target, type | ModuleType) else type(target).__name__
    return RuntimeError(
        f"lightning_accel relies on {owner}.{name}, a private member of Lightning that"
        f" lightning=={_lightning_version()} does not have. Install a Lightning version lightning_accel supports"
        " (see its 'lightning' requirement) or report this incompatibility."
    )


def lightning_private(target: object, name: str) -> Any:
    """``getattr(target, name)`` for a private Lightning member, checked to exist.

    Args:
        target: The Lightning object (trainer, loop, strategy, ...).
        name: The private attribute's name.

    Raises:
        RuntimeError: Naming the attribute and the installed Lightning version when it is missing.

    """
    try:
        return getattr(target, name)
    except AttributeError:
        raise missing_private_error(target, name) from None


def set_lightning_private(target: object, name: str, value: Any) -> None:
    """``setattr(target, name, value)`` for a private Lightning member that ``target`` must already have.

    Lightning sets the member (usually in its ``__init__``); replacing one it no longer has would create an attribute
    nothing reads, a silent no-op.

    Args:
        target: The Lightning object.
        name: The private attribute's name.
        value: The new value.

    Raises:
        RuntimeError: Naming the attribute and the installed Lightning version when ``target`` lacks it.

    """
    lightning_private(target, name)
    setattr(target, name, value)


def fabric_forward_module(model: Module) -> Module:
    """The module a Fabric wrapper (``_FabricModule``) runs ``forward`` on (DDP, FSDP, engine), or ``model`` itself.

    Raises:
        RuntimeError: If ``model`` is Fabric's wrapper and this Lightning version keeps the module elsewhere.

    """
    from lightning.fabric.wrappers import _FabricModule

    if not isinstance(model, _FabricModule):
        return model
    inner: Module = lightning_private(model, "_forward_module")
    return inner


def _lightning_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base.__module__.partition(".")[0] == "lightning"]


def lightning_private_members(*names: str) -> Callable[[_Class], _Class]:
    """Class decorator: the private members of its Lightning base classes the class overrides or calls.

    Each name must be defined by a Lightning class among the decorated class's bases; checked when the class is
    defined, so an override of a method Lightning renamed (which Lightning would silently stop calling) fails at
    import instead.

    Args:
        names: Private method or class-attribute names, e.g. ``"_configure_launcher"``.

    Returns:
        The decorator, which returns the class unchanged apart from the recorded names.

    Raises:
        RuntimeError: At class definition, naming the class, the member and the installed Lightning version, when no
            Lightning base class defines a member.
        TypeError: If a name is not private or the class has no Lightning base class.

    Example:
        >>> from lightning.fabric.strategies import DDPStrategy
        >>> @lightning_private_members("_configure_launcher")
        ... class MyDDP(DDPStrategy):
        ...     def _configure_launcher(self) -> None:
        ...         super()._configure_launcher()

    """
    public = [name for name in names if not name.startswith("_") or name.startswith("__")]
    if public:
        raise TypeError(f"lightning_private_members lists private members (one leading underscore), got {public}.")

    def check(cls: _Class) -> _Class:
        bases = _lightning_bases(cls)
        if not bases:
            raise TypeError(f"{cls.__qualname__} has no Lightning base class to take private members from.")
        for name in names:
            if not any(name in vars(base) for base in bases):
                raise RuntimeError(
                    f"lightning_accel's {cls.__qualname__} overrides or calls {name}, a private member of its"
                    f" Lightning base classes ({', '.join(base.__name__ for base in bases)}) that"
                    f" lightning=={_lightning_version()} does not have. Install a Lightning version lightning_accel"
                    " supports (see its 'lightning' requirement) or report this incompatibility."
                )
        setattr(cls, LIGHTNING_PRIVATES_ATTRIBUTE, frozenset(names))
        return cls

    return check


def declared_lightning_privates(cls: type) -> frozenset[str]:
    """The private Lightning members ``cls`` and its bases declared with :func:`lightning_private_members`."""
    declared: frozenset[str] = frozenset()
    for base in cls.__mro__:
        declared |= vars(base).get(LIGHTNING_PRIVATES_ATTRIBUTE, frozenset())
    return declared
