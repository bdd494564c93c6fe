"""The ``lightning-accel`` command: ``env``, ``config --default``, ``trainer-args`` and ``launch``.

``launch`` takes ``accelerate launch``'s options (``--config_file``, ``--num_processes``, ``--num_machines``,
``--machine_rank``, ``--main_process_ip``, ``--main_process_port``, ``--mixed_precision``, ``--use_fsdp``,
``--fsdp_*``, ``--zero_stage``, ``--dynamo_backend``, ...): options given on the command line win over the config file,
which wins over the defaults. It starts the processes with ``torch.distributed.run`` and the environment
``accelerate launch`` sets, so both Accelerate-style scripts and Lightning scripts (``strategy="acc_auto"`` or
``lightning_accel.trainer_kwargs()``) pick up the configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["main"]

_TYPE_FLAGS = {
    "multi_gpu": "MULTI_GPU",
    "use_fsdp": "FSDP",
    "use_deepspeed": "DEEPSPEED",
    "use_megatron_lm": "MEGATRON_LM",
    "tpu": "XLA",
}
# Boolean settings that are plain switches on `accelerate launch`'s command line; the others take true/false.
_SWITCHES = (
    "debug",
    "same_network",
    "enable_cpu_affinity",
    "downcast_bf16",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)
_TORCHRUN_PASSTHROUGH = ("max_restarts", "monitor_interval", "tee", "log_dir", "role", "rdzv_conf")
_OPTIONAL_PACKAGES = ("accelerate", "deepspeed", "torchao", "transformer_engine", "wandb", "torch_xla")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for invalid input, with the reason on stderr)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-accel {args.command}: error: {err}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "lightning-accel", description="Accelerate's config files and launcher, for Lightning and lightning_accel."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="Print versions, devices, collective backends and the default config.")
    env.set_defaults(handler=_run_env)
    config = commands.add_parser("config", help="Write a config file (`--default`: one for this machine).")
    config.add_argument("--default", action="store_true", help="Write a basic config for this machine.")
    config.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16", "fp8"])
    config.add_argument("--config_file", default=None, help="Where to write (default: Accelerate's default file).")
    config.set_defaults(handler=_run_config)
    trainer_args = commands.add_parser("trainer-args", help="Print the lightning.Trainer arguments a config means.")
    trainer_args.add_argument("--config_file", default=None, help="The file (default: Accelerate's default file).")
    trainer_args.add_argument(
        "--launch_env", action="store_true", help="Also print the variables `launch` sets for it."
    )
    trainer_args.set_defaults(handler=_run_trainer_args)
    launch = commands.add_parser("launch", help="Start a training script on the configured processes.")
    _add_launch_arguments(launch)
    launch.set_defaults(handler=_run_launch)
    return parser


# ---------------------------------------------------------------------------------------------------------- env


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    from lightning_accel.config.devices import BACKEND_BY_TYPE

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(cuda))
    lines = [f"CPU cores: {os.cpu_count()}", f"CUDA devices: {cuda}" + (f" ({names})" if names else "")]
    for backend in BACKEND_BY_TYPE.values():
        if backend.device_type not in ("cpu", "cuda") and not backend.extension_missing():
            backend.import_extension()
            module = getattr(torch, backend.device_type, None)
            count = module.device_count() if module is not None and module.is_available() else 0
            lines.append(f"{backend.device_type.upper()} devices: {count}")
    available = [name for name in ("gloo", "nccl", "mpi", "ucc", "xccl") if _backend_available(dist, name)]
    lines.append(f"Collective backends: {', '.join(available) or 'none'}")
    return lines


def _backend_available(dist: Any, name: str) -> bool:
    check = getattr(dist, f"is_{name}_available", None)
    return bool(check()) if check is not None else False


def _run_env(args: argparse.Namespace) -> int:
    import lightning_accel
    from lightning_accel.config import load_config
    from lightning_accel.utils.environment import default_config_file

    print(f"lightning_accel: {lightning_accel.__version__}")
    print(f"Platform: {platform.platform()}")
    print(f"Python: {platform.python_version()}")
    for name in ("torch", "lightning", *_OPTIONAL_PACKAGES):
        print(f"{name}: {_package_version(name)}")
    for line in _device_lines():
        print(line)
    path = default_config_file()
    if not path.is_file():
        print(f"Default config: none ({path} does not exist; `lightning-accel config --default` writes one)")
        return 0
    print(f"Default config ({path}):")
    try:
        print("  " + yaml.safe_dump(load_config(path).to_dict()).rstrip().replace("\n", "\n  "))
    except ValueError as err:
        print(f"  invalid: {err}")
    return 0


# ------------------------------------------------------------------------------------------------------- config


def _run_config(args: argparse.Namespace) -> int:
    from lightning_accel.config import write_machine_config
    from lightning_accel.utils.environment import default_config_file

    if not args.default:
        raise ValueError(
            "only `lightning-accel config --default` is implemented (no questionnaire): it writes a basic config "
            "you can edit; `accelerate config` writes the same files interactively"
        )
    written = write_machine_config(args.mixed_precision, args.config_file or default_config_file())
    if written is False:
        return 1
    print(f"Accelerate config written to {written}")
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
    from lightning_accel.strategies.arguments import settings_trainer_kwargs, strategy_entry, strategy_options
    from lightning_accel.utils.environment import default_config_file, env_from_settings

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


# ------------------------------------------------------------------------------------------------------- launch


def _add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_accel.config._settings import SECTIONS, SETTINGS, parse_bool

    parser.add_argument("--config_file", default=None, help="Accelerate config file (default: the default file).")
    types = parser.add_argument_group("distributed type (overrides the file's distributed_type)")
    types.add_argument("--cpu", action="store_true", help="Train on CPU (use_cpu).")
    for flag, dtype in _TYPE_FLAGS.items():
        types.add_argument(f"--{flag}", action="store_true", help=f"distributed_type {dtype}.")
    types.add_argument(
        "--use_parallelism_config",
        action="store_true",
        help="N-D parallelism (acc_parallel) from the --parallelism_config_* sizes; composes with --use_fsdp, --cpu.",
    )
    groups: dict[str | None, Any] = {None: parser.add_argument_group("settings (as in the config file)")}
    groups.update({section: parser.add_argument_group(section) for section in SECTIONS})
    for setting in SETTINGS:
        if setting.name == "use_cpu":
            continue
        group = groups[setting.section]
        if setting.name in _SWITCHES:
            group.add_argument(f"--{setting.name}", action="store_const", const=True, default=None)
        else:
            metavar = "true|false" if setting.parse is parse_bool else "VALUE"
            group.add_argument(f"--{setting.name}", default=None, metavar=metavar)
    launcher = parser.add_argument_group("launcher")
    launcher.add_argument("--num_cpu_threads_per_process", type=int, default=None, help="OMP_NUM_THREADS per worker.")
    launcher.add_argument("-m", "--module", action="store_true", help="Run the script as a Python module.")
    launcher.add_argument("--no_python", action="store_true", help="Run the script as a program, not with Python.")
    for name in _TORCHRUN_PASSTHROUGH:
        launcher.add_argument(f"--{name}", default=None, help="Passed to torch.distributed.run.")
    parser.add_argument("training_script", help="The script to run (or module, or program).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments for the script.")


def _explicit_settings(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_accel.config._settings import SETTINGS, parse_distributed_type

    explicit = {
        s.name: s.parse(f"--{s.name}", getattr(args, s.name))
        for s in SETTINGS
        if getattr(args, s.name, None) is not None
    }
    chosen = [f"--{flag}" for flag in _TYPE_FLAGS if getattr(args, flag)]
    if "distributed_type" in explicit:
        chosen.append(f"--distributed_type {explicit['distributed_type'].value}")
    if len(chosen) > 1:
        raise ValueError(f"choose one distributed type, got {' and '.join(chosen)}")
    for flag, dtype in _TYPE_FLAGS.items():
        if getattr(args, flag):
            explicit["distributed_type"] = parse_distributed_type(f"--{flag}", dtype)
    if args.cpu:
        explicit["use_cpu"] = True
    return explicit


def _defaults_without_config(settings: dict[str, Any]) -> None:
    """Fill what a config file would give: every local GPU (or one CPU process) per machine."""
    import torch

    from lightning_accel.enums import DistributedType

    machines = settings.setdefault("num_machines", 1)
    on_cuda = not settings.get("use_cpu") and torch.cuda.is_available()
    settings.setdefault("num_processes", machines * (torch.cuda.device_count() if on_cuda else 1))
    if "distributed_type" not in settings:
        several = settings["num_processes"] > 1
        multi = DistributedType.MULTI_GPU if on_cuda else DistributedType.MULTI_CPU
        settings["distributed_type"] = multi if several else DistributedType.NO


def launch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line settings over the config file (``--config_file``, else the default file if it exists)."""
    from lightning_accel.cli.launch import parallelism_settings
    from lightning_accel.config import load_config
    from lightning_accel.utils.environment import default_config_file

    path = Path(args.config_file) if args.config_file else default_config_file()
    config = load_config(path) if args.config_file or path.is_file() else None
    settings = config.settings() if config is not None else {}
    explicit = _explicit_settings(args)
    settings.update(explicit)
    if args.cpu and "distributed_type" not in explicit:
        _data_parallel_on_cpu(settings)
    settings = parallelism_settings(
        settings, args.use_parallelism_config, in_file=config is not None and bool(config.parallelism_config)
    )
    if config is None:
        _defaults_without_config(settings)
    return settings


def _data_parallel_on_cpu(settings: dict[str, Any]) -> None:
    """``--cpu`` turns a file's device data parallelism (``MULTI_GPU``, ``MULTI_NPU``, ...) into ``MULTI_CPU``."""
    from lightning_accel.config.devices import BACKEND_BY_TYPE
    from lightning_accel.enums import DistributedType

    dtype = settings.get("distributed_type")
    backend = BACKEND_BY_TYPE.get(dtype) if dtype is not None else None
    if backend is not None and backend.device_type != "cpu":
        settings["distributed_type"] = DistributedType.MULTI_CPU


def _run_launch(args: argparse.Namespace) -> int:
    from lightning_accel.cli.launch import plan_launch, run_plan
    from lightning_accel.utils.environment import cpu_threads_per_process

    passthrough = [
        item
        for name in _TORCHRUN_PASSTHROUGH
        if getattr(args, name) is not None
        for item in (f"--{name}", getattr(args, name))
    ]
    plan = plan_launch(
        launch_settings(args),
        [args.training_script, *args.training_script_args],
        cpu_threads=args.num_cpu_threads_per_process or cpu_threads_per_process(),
        module=args.module,
        no_python=args.no_python,
        torchrun_options=passthrough,
    )
    return run_plan(plan)


if __name__ == "__main__":
    sys.exit(main())
