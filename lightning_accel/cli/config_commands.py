"""Config file commands: ``config`` (``--default``, ``default``, ``update``), ``to-fsdp2`` and ``trainer-args``.

``config default`` and ``config update`` are ``accelerate config default|update``: the first writes a basic file for
this machine (never overwriting one), the second rewrites a file with every default spelled out. ``to-fsdp2`` turns an
FSDP1 file into an FSDP2 one as ``accelerate to-fsdp2`` does. ``trainer-args`` explains what a file means to
``lightning.Trainer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_config_parsers", "convert_to_fsdp2"]

_PRECISIONS = ["no", "fp16", "bf16", "fp8"]
_FILE_HELP = "The config file (default: Accelerate's, $HF_HOME/accelerate/default_config.yaml)."

# FSDP1 keys that FSDP2 drops (fully_shard has no such option) and why.
_FSDP2_DROPS = {
    "fsdp_backward_prefetch": "FSDP2 always prefetches in backward",
    "fsdp_forward_prefetch": "FSDP2 has no forward prefetching option yet",
    "fsdp_sync_module_states": "FSDP2 broadcasts from rank 0 with fsdp_cpu_ram_efficient_loading",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
}
# FSDP1 sharding strategies as FSDP2's fsdp_reshard_after_forward (the hybrid ones need a parallelism_config mesh).
_RESHARD_BY_STRATEGY = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
_STRATEGY_KEYS = ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")


def add_config_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``config`` (with ``default`` and ``update``), ``to-fsdp2`` and ``trainer-args`` to ``commands``."""
    config = commands.add_parser(
        "config", help="Write a config file: `config default` (or `config --default`), `config update`."
    )
    config.add_argument("--default", action="store_true", help="Write a basic config for this machine.")
    config.add_argument("--mixed_precision", default="no", choices=_PRECISIONS)
    config.add_argument("--config_file", default=None, help="Where to write (default: Accelerate's default file).")
    config.set_defaults(handler=_run_config)
    modes = config.add_subparsers(dest="config_command", metavar="{default,update}")
    default = modes.add_parser("default", help="Write a basic config for this machine (never overwrites).")
    default.add_argument("--config_file", default=None, help="Where to write (default: Accelerate's default file).")
    default.add_argument("--mixed_precision", default="no", choices=_PRECISIONS)
    default.set_defaults(handler=_run_config_default)
    update = modes.add_parser("update", help="Rewrite a config file with every default spelled out.")
    update.add_argument("--config_file", default=None, help=_FILE_HELP)
    update.set_defaults(handler=_run_config_update)

    to_fsdp2 = commands.add_parser("to-fsdp2", help="Convert an FSDP1 config file to FSDP2.")
    to_fsdp2.add_argument("--config_file", required=True, help="The FSDP1 config file to convert.")
    to_fsdp2.add_argument("--output_file", default=None, help="Where to write (required without --overwrite).")
    to_fsdp2.add_argument(
        "--overwrite", action="store_true", help="Replace --output_file if it exists (or the input without one)."
    )
    to_fsdp2.set_defaults(handler=_run_to_fsdp2)

    trainer_args = commands.add_parser("trainer-args", help="Print the lightning.Trainer arguments a config means.")
    trainer_args.add_argument("--config_file", default=None, help=_FILE_HELP)
    trainer_args.add_argument(
        "--launch_env", action="store_true", help="Also print the variables `launch` sets for it."
    )
    trainer_args.set_defaults(handler=_run_trainer_args)


# ------------------------------------------------------------------------------------------------------- config


def _write_default(mixed_precision: str, config_file: str | None) -> int:
    from lightning_accel.config import write_machine_config
    from lightning_accel.launch_settings import default_config_file

    written = write_machine_config(mixed_precision, config_file or default_config_file())
    if written is False:
        return 1
    print(f"Accelerate config written to {written}")
    return 0


def _run_config(args: argparse.Namespace) -> int:
    if not args.default:
        raise ValueError(
            "only `lightning-accel config --default` is implemented (also spelled `config default`), with "
            "`config update`; there is no questionnaire: it writes a basic config you can edit, and `accelerate "
            "config` writes the same files interactively"
        )
    return _write_default(args.mixed_precision, args.config_file)


def _run_config_default(args: argparse.Namespace) -> int:
    return _write_default(args.mixed_precision, args.config_file)


def _run_config_update(args: argparse.Namespace) -> int:
    from lightning_accel.config import load_config
    from lightning_accel.launch_settings import default_config_file

    path = Path(args.config_file) if args.config_file else default_config_file()
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {str(path)!r} does not exist; pass --config_file with an existing file, or write one "
            "with `lightning-accel config default`"
        )
    load_config(path).save(path)
    print(f"Config file {path} updated: every setting is written, with its default where the file left it out.")
    return 0


# ----------------------------------------------------------------------------------------------------- to-fsdp2


def _reshard_after_forward(key: str, value: Any) -> Any:
    """FSDP2's ``fsdp_reshard_after_forward`` for an FSDP1 strategy (name or 1-based index); booleans stay."""
    from lightning_accel.config._settings import parse_sharding_strategy

    if isinstance(value, bool):
        return value
    try:
        strategy = parse_sharding_strategy(f"fsdp_config.{key}", value)
    except ValueError:
        return value  # not a strategy: left for the config reader to name
    if strategy.startswith("HYBRID"):
        print(
            f"lightning-accel to-fsdp2: {key}: {strategy} becomes fsdp_reshard_after_forward; FSDP2 shards within "
            "and replicates across the nodes only with a parallelism_config (dp_replicate_size, dp_shard_size)",
            file=sys.stderr,
        )
    return _RESHARD_BY_STRATEGY[strategy]


def _canonical_fsdp_key(key: Any) -> Any:
    """``fsdp_``-less aliases (``sharding_strategy``, ...) as the keys the FSDP2 config reader knows."""
    from lightning_accel.config._settings import setting_for

    try:
        return setting_for("fsdp_config", key).key
    except KeyError:
        return key


def convert_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """An Accelerate config's ``fsdp_config`` as FSDP2 options, as ``accelerate to-fsdp2`` converts it.

    The sharding strategy becomes ``fsdp_reshard_after_forward``, the options FSDP2 lacks are dropped (a note on
    stderr says which), the others are kept and ``fsdp_version`` becomes 2. A config without ``fsdp_config``, or one
    already at version 2, comes back unchanged. Unlike ``accelerate to-fsdp2``, a strategy given by its index
    (``fsdp_sharding_strategy: 2``) and keys without the ``fsdp_`` prefix are converted too.

    Args:
        config: The file's mapping; it is not modified.

    Returns:
        The converted mapping.

    """
    section = config.get("fsdp_config") or {}
    if not section:
        print("lightning-accel to-fsdp2: no fsdp_config in the file; written unchanged", file=sys.stderr)
        return dict(config)
    if section.get("fsdp_version", 1) == 2:
        print("lightning-accel to-fsdp2: the file already sets fsdp_version: 2; written unchanged", file=sys.stderr)
        return dict(config)
    converted: dict[str, Any] = {}
    for raw_key, value in section.items():
        key = _canonical_fsdp_key(raw_key)
        if key in _FSDP2_DROPS:
            print(f"lightning-accel to-fsdp2: dropped {raw_key} ({_FSDP2_DROPS[key]})", file=sys.stderr)
        elif key in _STRATEGY_KEYS:
            converted["fsdp_reshard_after_forward"] = _reshard_after_forward(raw_key, value)
        else:
            converted[key] = value
    converted["fsdp_version"] = 2
    return {**config, "fsdp_config": converted}


def _to_fsdp2_target(args: argparse.Namespace) -> Path:
    source = Path(args.config_file)
    if not source.is_file():
        raise FileNotFoundError(f"config file {str(source)!r} does not exist; pass an existing --config_file")
    if args.output_file is None:
        if not args.overwrite:
            raise ValueError("pass --output_file, or --overwrite to replace the input file")
        return source
    target = Path(args.output_file)
    if target.exists() and not args.overwrite:
        raise FileExistsError(f"{target} already exists; pass --overwrite to replace it, or another --output_file")
    return target


def _run_to_fsdp2(args: argparse.Namespace) -> int:
    target = _to_fsdp2_target(args)
    try:
        config = yaml.safe_load(Path(args.config_file).read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{args.config_file}: not a valid YAML/JSON file ({err})") from None
    if not config:
        raise ValueError(f"{args.config_file} is empty; pass an Accelerate config file")
    if not isinstance(config, dict):
        raise ValueError(f"{args.config_file} holds {type(config).__name__}, not an Accelerate config mapping")
    target.write_text(yaml.safe_dump(convert_to_fsdp2(config)), encoding="utf-8")
    print(f"FSDP2 config written to {target}")
    return 0


# ------------------------------------------------------------------------------------------------- trainer-args


def _describe_options(options: dict[str, Any]) -> list[str]:
    lines = []
    for name, value in options.items():
        lines.append(f"  {name}: {type(value).__name__}")
        if dataclasses.is_dataclass(value):
            lines += [f"    {f.name} = {getattr(value, f.name)!r}" for f in dataclasses.fields(value)]
        deepspeed_config = getattr(value, "deepspeed_config", None)
        if isinstance(deepspeed_config, dict):
            lines.append("    DeepSpeed config: " + yaml.safe_dump(deepspeed_config).rstrip().replace("\n", "\n      "))
    return lines


def _run_trainer_args(args: argparse.Namespace) -> int:
    from lightning_accel.config import load_config
    from lightning_accel.launch_settings import default_config_file, env_from_settings
    from lightning_accel.strategies.from_settings import settings_trainer_kwargs, strategy_entry, strategy_options

    config = load_config(args.config_file or default_config_file())
    settings = config.settings()
    kwargs = settings_trainer_kwargs(settings)
    entry = strategy_entry(settings)
    source = args.config_file or "the default config"
    print(
        f"# {source}: {config.distributed_type.value}, {kwargs['devices']} process(es) per machine on "
        f"{kwargs['num_nodes']} machine(s)"
    )
    print("lightning.Trainer(")
    for key, value in kwargs.items():
        shown = f"{type(value).__name__}(...)  # {entry.name!r}" if key == "strategy" else f"{value!r},"
        print(f"    {key}={shown}")
    print(")")
    options = strategy_options(settings)
    if options:
        print("strategy arguments:")
        print("\n".join(_describe_options(options)))
    if args.launch_env:
        print("variables `lightning-accel launch` sets:")
        for name, value in sorted(env_from_settings(settings).items()):
            print(f"  {name}={value}")
    return 0
