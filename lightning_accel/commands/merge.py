"""``accelerate.commands.merge``: the ``merge-weights`` parser and its action, as functions a program can call.

``merge_command_parser()`` returns a parser of ``CHECKPOINT_DIRECTORY OUTPUT_PATH [--unsafe_serialization]
[--remove_checkpoint_dir]`` and ``merge_command(args)`` merges what it parsed with
:func:`lightning_accel.utils.merge_fsdp_weights`. The ``lightning-accel merge-weights`` command (:mod:`.cli`) reads
Lightning's sharded checkpoints too.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["merge_command", "merge_command_parser"]

_DESCRIPTION = "Merge the shards of an FSDP SHARDED_STATE_DICT checkpoint (pytorch_model_fsdp_0) into one weights file."


def merge_command(args: argparse.Namespace) -> None:
    """Merge ``args.checkpoint_directory`` into ``args.output_path`` (safetensors unless ``--unsafe_serialization``)."""
    from lightning_accel.utils import merge_fsdp_weights

    merge_fsdp_weights(
        args.checkpoint_directory,
        args.output_path,
        safe_serialization=not args.unsafe_serialization,
        remove_checkpoint_dir=args.remove_checkpoint_dir,
    )


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser: on its own, or added to ``subparsers`` (an ``add_subparsers()`` result)."""
    if subparsers is None:
        parser = argparse.ArgumentParser(description=_DESCRIPTION)
    else:
        parser = subparsers.add_parser("merge-weights", description=_DESCRIPTION)
    parser.add_argument("checkpoint_directory", help="The folder of FSDP shards (pytorch_model_fsdp_0).")
    parser.add_argument("output_path", help="The folder to write model.safetensors (or pytorch_model.bin) in.")
    parser.add_argument("--unsafe_serialization", action="store_true", help="Write pytorch_model.bin (torch.save).")
    parser.add_argument("--remove_checkpoint_dir", action="store_true", help="Delete the shards after merging.")
    if subparsers is not None:
        parser.set_defaults(func=merge_command)
    return parser
