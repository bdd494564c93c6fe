"""Readers of single environment variables, and helpers that set variables for a block of code.

The bottom of the launch settings: every other reader of ``ACCELERATE_*`` variables parses text with these, and
:mod:`lightning_accel.state` reads the variables it needs here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch

from lightning_accel.config._settings import _FALSE_WORDS, _TRUE_WORDS

__all__ = [
    "convert_dict_to_env_variables",
    "get_int_from_env",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "str_to_bool",
    "torch_device_from_env",
]

# Named for the module users know it from (Accelerate's logger is ``accelerate.utils.environment``).
logger = logging.getLogger("lightning_accel.utils.environment")

_FORBIDDEN_ENV_CHARS = (";", "\n", "<", ">", " ")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Accelerate's truth words: ``1`` for y, yes, t, true, on, 1 and ``0`` for n, no, f, false, off, 0 (any case).

    Args:
        value: The text (any case).
        to_bool: Return ``True``/``False`` instead of Accelerate's default ``1``/``0``.

    Raises:
        ValueError: For any other text.

    """
    word = value.lower()
    if word in _TRUE_WORDS:
        return True if to_bool else 1
    if word in _FALSE_WORDS:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {', '.join(_TRUE_WORDS + _FALSE_WORDS)}")


def parse_flag_from_env(key: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable ``key`` holds a true word (``default`` when unset).

    Raises:
        ValueError: If the variable holds something other than a truth word.

    """
    return str_to_bool(_environ(environ).get(key, str(default))) == 1


def torch_device_from_env(environ: Mapping[str, str] | None = None) -> torch.device | None:
    """The device ``ACCELERATE_TORCH_DEVICE`` names (``"cuda:3"``, ``"cpu"``), overriding the one picked by default.

    Raises:
        ValueError: If the variable holds something ``torch.device`` cannot parse.

    """
    text = _environ(environ).get("ACCELERATE_TORCH_DEVICE")
    if not text:
        return None
    try:
        return torch.device(text)
    except RuntimeError as error:
        raise ValueError(
            f"ACCELERATE_TORCH_DEVICE={text!r} is not a torch device: set it to a device such as 'cuda:0' or 'cpu'."
        ) from error


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=value`` lines (each ending in a newline) for an environment file; unsafe or empty entries are left out.

    An entry is left out, with a warning, when its key or value is empty or holds ``;``, a newline, ``<``, ``>`` or a
    space.
    """
    lines = []
    for key, value in current_env.items():
        if key and value and not any(char in key + value for char in _FORBIDDEN_ENV_CHARS):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning(
                "Leaving %s=%s out of the environment file: empty, or holding ; < > a space or a newline",
                key,
                value,
            )
    return lines


def get_int_from_env(env_keys: Sequence[str], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default`` (Accelerate's reader).

    Raises:
        ValueError: If a variable holds something that is not an integer.

    """
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The text of the variable ``key``, or ``str(default)`` when it is unset."""
    return os.environ.get(key, str(default))
