"""``lightning-accel env``: versions, devices, collective backends and a config file (``accelerate env``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_env_parser"]

_OPTIONAL_PACKAGES = ("accelerate", "deepspeed", "torchao", "transformer_engine", "wandb", "torch_xla")


def add_env_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``env`` to ``commands``."""
    env = commands.add_parser("env", help="Print versions, devices, collective backends and the config file.")
    env.add_argument(
        "--config_file", default=None, help="The config file to show (default: Accelerate's default file, if any)."
    )
    env.set_defaults(handler=_run_env)


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


def _config_lines(path: Path, passed: bool) -> list[str]:
    """The config file's content, or why there is none; a file passed with ``--config_file`` must load."""
    from lightning_accel.config import load_config

    if not passed and not path.is_file():
        return [f"Default config: none ({path} does not exist; `lightning-accel config default` writes one)"]
    title = f"{'Config passed' if passed else 'Default config'} ({path}):"
    try:
        content = load_config(path).to_dict()
    except ValueError as err:
        if passed:
            raise
        return [title, f"  invalid: {err}"]
    return [title, "  " + yaml.safe_dump(content).rstrip().replace("\n", "\n  ")]


def _run_env(args: argparse.Namespace) -> int:
    import lightning_accel
    from lightning_accel.launch_settings import default_config_file

    print(f"lightning_accel: {lightning_accel.__version__}")
    print(f"Platform: {platform.platform()}")
    print(f"Python: {platform.python_version()}")
    for name in ("torch", "lightning", *_OPTIONAL_PACKAGES):
        print(f"{name}: {_package_version(name)}")
    for line in _device_lines():
        print(line)
    passed = args.config_file is not None
    for line in _config_lines(Path(args.config_file) if passed else default_config_file(), passed):
        print(line)
    return 0
