"""``lightning-accel merge-weights``: a sharded FSDP checkpoint as one weights file (``accelerate merge-weights``).

Two kinds of sharded checkpoint are read, in this one process, without FSDP or a process group:

- the ``pytorch_model_fsdp_{i}`` folder ``Accelerator.save_state`` writes under FSDP with ``SHARDED_STATE_DICT``
  (a ``torch.distributed.checkpoint`` folder), merged by :func:`lightning_accel.utils.merge_fsdp_weights`;
- the folder ``Trainer.save_checkpoint`` (or ``Fabric.save``) writes with the ``acc_fsdp`` strategy and
  ``SHARDED_STATE_DICT`` (shards plus ``meta.pt``), whose model entry (``state_dict`` for the Trainer) is written;
  ``--prefix`` strips the LightningModule's attribute name (``net.``) so the file loads into the bare model.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

__all__ = ["add_merge_weights_parser"]


def add_merge_weights_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``merge-weights`` to ``commands``."""
    parser = commands.add_parser(
        "merge-weights",
        help="Merge a sharded FSDP checkpoint into model.safetensors (or pytorch_model.bin).",
        description="Merge the shards of an FSDP SHARDED_STATE_DICT checkpoint into one weights file in "
        "OUTPUT_PATH. It runs on CPU and holds the whole state dict in memory.",
    )
    parser.add_argument(
        "checkpoint_directory",
        help="A pytorch_model_fsdp_0 folder (Accelerator.save_state) or a sharded acc_fsdp Trainer/Fabric checkpoint.",
    )
    parser.add_argument("output_path", help="The folder to write model.safetensors (or pytorch_model.bin) in.")
    parser.add_argument(
        "--unsafe_serialization", action="store_true", help="Write pytorch_model.bin (torch.save), not safetensors."
    )
    parser.add_argument(
        "--remove_checkpoint_dir", action="store_true", help="Delete the checkpoint folder after merging."
    )
    parser.add_argument(
        "--key",
        default="state_dict",
        help="For a Trainer/Fabric checkpoint: the entry holding the model (default: the Trainer's state_dict).",
    )
    parser.add_argument(
        "--prefix", default="", help="For a Trainer/Fabric checkpoint: keep the keys with this prefix, stripped."
    )
    parser.set_defaults(handler=_run_merge_weights)


def _sharded_entries(source: Path) -> list[str]:
    """The top-level entries a ``torch.distributed.checkpoint`` folder holds shards of (``state_dict``, ...)."""
    from lightning_accel.utils.modeling.checkpoint import contained_reader

    keys = contained_reader(source).read_metadata().state_dict_metadata  # .metadata checked before DCP unpickles it
    return sorted({key.split(".", 1)[0] for key in keys})


def _merge_lightning_checkpoint(source: Path, target: Path, key: str, prefix: str, safe: bool) -> Path:
    """Write the model entry of a sharded ``acc_fsdp`` checkpoint folder into ``target``; returns the file."""
    from lightning_accel.utils.constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
    from lightning_accel.utils.modeling.checkpoint import load_full_state_dict
    from lightning_accel.utils.other import save

    entries = _sharded_entries(source)
    if key not in entries:
        raise ValueError(f"{source} has no sharded {key!r} entry; pass --key with one of {entries}")
    try:
        weights = load_full_state_dict(source, prefix=prefix, key=key)
    except KeyError as err:  # no key starts with the prefix
        raise ValueError(f"{source}: {str(err.args[0]).rstrip('.')}; fix --prefix") from None
    target.mkdir(parents=True, exist_ok=True)
    path = target / (SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME)
    save(weights, path, safe_serialization=safe)
    return path


def _merge_accelerate_checkpoint(source: Path, target: Path, safe: bool) -> Path:
    from lightning_accel.utils.constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
    from lightning_accel.utils.fsdp_utils import merge_fsdp_weights

    try:
        merge_fsdp_weights(source, target, safe_serialization=safe)
    except TypeError as err:  # an optimizer checkpoint: nested state, which safetensors cannot hold
        raise ValueError(f"{source} holds more than tensors ({err}); merge it with --unsafe_serialization") from None
    return target / (SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME)


def _run_merge_weights(args: argparse.Namespace) -> int:
    from lightning_accel.utils.modeling.checkpoint import is_sharded_checkpoint

    source, target = Path(args.checkpoint_directory), Path(args.output_path)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder; pass the sharded checkpoint folder to merge")
    safe = not args.unsafe_serialization
    if is_sharded_checkpoint(source):
        written = _merge_lightning_checkpoint(source, target, args.key, args.prefix, safe)
    else:
        if args.prefix or args.key != "state_dict":
            raise ValueError(
                f"--key and --prefix apply to Trainer/Fabric checkpoints (with meta.pt); {source} is not one"
            )
        written = _merge_accelerate_checkpoint(source, target, safe)
    if args.remove_checkpoint_dir:
        shutil.rmtree(source)
    print(f"Merged weights written to {written}")
    return 0
