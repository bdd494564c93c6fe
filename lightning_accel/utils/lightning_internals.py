"""Lightning's private attributes, used with a check: a Lightning release that renamed one fails with a clear error.

lightning_accel patches or reads a few private members of Lightning objects (a loop's ``_should_accumulate``, the
trainer's ``_checkpoint_connector``, ...). They are not part of Lightning's API and may change in any release; going
through :func:`lightning_private` turns a silent no-op or a bare ``AttributeError`` deep inside a run into an error
that names the member, the object and the installed Lightning version.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lightning_private", "missing_private_error"]


def missing_private_error(target: object, name: str) -> RuntimeError:
    """The error for a private Lightning member that this Lightning version lacks."""
    import lightning

    return RuntimeError(
        f"lightning_accel relies on {type(target).__name__}.{name}, a private member of Lightning that"
        f" lightning=={lightning.__version__} does not have. Install a Lightning version lightning_accel supports"
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
