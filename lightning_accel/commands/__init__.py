"""Accelerate's ``accelerate.commands`` modules that programs import as functions (the command line is :mod:`.cli`).

``accelerate.commands.merge`` is imported by scripts that merge FSDP shards themselves (Accelerate's own
``test_merge_weights.py``); :mod:`lightning_accel.commands.merge` offers the same two functions.
"""

from __future__ import annotations

from lightning_accel.commands.merge import merge_command, merge_command_parser

__all__ = ["merge_command", "merge_command_parser"]
