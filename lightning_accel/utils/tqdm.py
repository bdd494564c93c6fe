"""Accelerate's ``tqdm`` (its ``accelerate.utils.tqdm``): a progress bar shown on each node's main process only."""

from __future__ import annotations

from typing import Any

from lightning_accel.state import PartialState
from lightning_accel.utils.imports import is_tqdm_available

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but local rank 0 with ``main_process_only``.

    Args:
        *args: ``tqdm``'s positional arguments (the iterable first).
        main_process_only: Show the bar on each node's main process only (local process index 0).
        **kwargs: ``tqdm``'s keyword arguments; ``disable=True`` hides it everywhere.

    Raises:
        ImportError: Without the ``tqdm`` package.
        ValueError: If the first argument is a bool (Accelerate's old ``tqdm(main_process_only, ...)`` call).

    """
    if not is_tqdm_available():
        raise ImportError("lightning_accel's tqdm needs the tqdm package: pip install tqdm")
    if args and isinstance(args[0], bool):
        raise ValueError(
            "Passing True or False as the first argument of tqdm is not supported: pass main_process_only=... as a "
            "keyword argument instead."
        )
    from tqdm.auto import tqdm as auto_tqdm

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return auto_tqdm(*args, **kwargs, disable=disable)
