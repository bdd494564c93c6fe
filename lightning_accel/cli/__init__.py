"""The ``lightning-accel`` command: ``main`` and ``launch``'s options (the other commands live beside it).

The commands: ``env``, ``config`` (``default``, ``update``), ``to-fsdp2``, ``trainer-args``, ``launch``, ``test``,
``estimate-memory`` and ``merge-weights``.

``launch`` takes ``accelerate launch``'s options (``--config_file``, ``--num_processes``, ``--num_machines``,
``--machine_rank``, ``--main_process_ip``, ``--main_process_port``, ``--mixed_precision``, ``--use_fsdp``,
``--fsdp_*``, ``--zero_stage``, ``--dynamo_backend``, ...): options given on the command line win over the config file,
which wins over the defaults. It starts the processes with ``torch.distributed.run`` and the environment
``accelerate launch`` sets, so both Accelerate-style scripts and Lightning scripts (``strategy="acc_auto"`` or
``lightning_accel.trainer_kwargs()``) pick up the configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.cli.launch import LaunchPlan

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
_TORCHRUN_PASSTHROUGH = ("max_restarts", "monitor_interval", "tee", "log_dir", "role")
_TPU_POD = (
    "lightning-accel launch does not start TPU pods over gcloud: run `lightning-accel launch --tpu` on each TPU VM "
    "(or use `accelerate launch --tpu_cluster`)"
)
_SAGEMAKER = "lightning-accel launch does not submit Amazon SageMaker jobs: use `accelerate launch` for those"
# `accelerate launch` options for launchers lightning-accel does not drive: accepted by the parser, then refused.
_REFUSED_OPTIONS = {
    "tpu_use_cluster": ("--tpu_cluster", _TPU_POD),
    "tpu_use_sudo": ("--tpu_use_sudo", _TPU_POD),
    "vm": ("--vm", _TPU_POD),
    "env": ("--env", _TPU_POD),
    "aws_access_key_id": ("--aws_access_key_id", _SAGEMAKER),
    "aws_secret_access_key": ("--aws_secret_access_key", _SAGEMAKER),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for invalid input, with the reason on stderr)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"lightning-accel {args.command}: error: {err}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    # Imported here: `python -m lightning_accel.cli.selftest` (what `test` launches) imports this package first.
    from lightning_accel.cli.config_commands import add_config_parsers
    from lightning_accel.cli.env import add_env_parser
    from lightning_accel.cli.memory import add_estimate_memory_parser
    from lightning_accel.cli.merge import add_merge_weights_parser
    from lightning_accel.cli.selftest import add_test_parser

    parser = argparse.ArgumentParser(
        "lightning-accel", description="Accelerate's config files and launcher, for Lightning and lightning_accel."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_env_parser(commands)
    add_config_parsers(commands)
    launch = commands.add_parser("launch", help="Start a training script on the configured processes.")
    _add_launch_arguments(launch)
    launch.set_defaults(handler=_run_launch)
    add_test_parser(commands)
    add_estimate_memory_parser(commands)
    add_merge_weights_parser(commands)
    return parser


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
        short = ["-t"] if name == "tee" else []  # accelerate launch's short spelling
        launcher.add_argument(*short, f"--{name}", default=None, help="Passed to torch.distributed.run.")
    launcher.add_argument(
        "--rdzv_conf",
        default=None,
        help="Rendezvous options key=value,... for torch.distributed.run (several machines: the timeout is added).",
    )
    launcher.add_argument(
        "-q", "--quiet", action="store_true", help="On failure, print only the workers' output, not the summary."
    )
    _add_refused_arguments(parser.add_argument_group("accelerate launch options for TPU pods and SageMaker (refused)"))
    parser.add_argument("training_script", help="The script to run (or module, or program).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="Arguments for the script.")


def _add_refused_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tpu_cluster", action="store_true", dest="tpu_use_cluster", help="Refused: a TPU pod.")
    group.add_argument("--no_tpu_cluster", action="store_false", dest="tpu_use_cluster", help="Not a TPU pod.")
    group.add_argument("--tpu_use_sudo", action="store_true", help="Refused: for TPU pods.")
    group.add_argument("--vm", action="append", default=None, help="Refused: TPU pod VM names.")
    group.add_argument("--env", action="append", default=None, help="Refused: TPU pod environment variables.")
    group.add_argument("--aws_access_key_id", default=None, help="Refused: for SageMaker jobs.")
    group.add_argument("--aws_secret_access_key", default=None, help="Refused: for SageMaker jobs.")


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """Raise for the first ``accelerate launch`` option given that belongs to a launcher not driven here."""
    for dest, (option, reason) in _REFUSED_OPTIONS.items():
        if getattr(args, dest, None):
            raise ValueError(f"{option} is not supported: {reason}")


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
    from lightning_accel.launch_settings import default_config_file

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
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from lightning_accel.cli.launch import run_plan

    plan = _plan(args)
    try:
        if not args.quiet:
            return run_plan(plan)
        with contextlib.redirect_stderr(io.StringIO()):  # the failure summary run_plan prints; workers write on
            return run_plan(plan)
    except RendezvousTimeoutError as err:  # a machine that never arrived: not an input error, so status 1
        print(f"lightning-accel launch: error: {err}", file=sys.stderr)
        return 1


def _plan(args: argparse.Namespace) -> LaunchPlan:
    """Plan the launch; its warnings (``--multi_gpu`` without GPUs, ...) are printed as the command's own."""
    from lightning_accel.cli.launch import plan_launch
    from lightning_accel.launch_settings import cpu_threads_per_process

    _refuse_unsupported(args)
    passthrough = [
        item
        for name in _TORCHRUN_PASSTHROUGH
        if getattr(args, name) is not None
        for item in (f"--{name}", getattr(args, name))
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        plan = plan_launch(
            launch_settings(args),
            [args.training_script, *args.training_script_args],
            cpu_threads=args.num_cpu_threads_per_process or cpu_threads_per_process(),
            module=args.module,
            no_python=args.no_python,
            torchrun_options=passthrough,
            rdzv_conf=args.rdzv_conf,
        )
    for warning in caught:
        print(f"lightning-accel launch: warning: {warning.message}", file=sys.stderr)
    return plan


if __name__ == "__main__":
    sys.exit(main())
