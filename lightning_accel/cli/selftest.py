"""``lightning-accel test``: a short self-check of a config on real processes (``accelerate test``).

The command starts ``lightning-accel launch [--config_file FILE] -m lightning_accel.cli.selftest``; every process
then runs :func:`run_checks` under the ``Accelerator`` the launch configures: the processes see each other, a
prepared data loader shards the data and ``gather_for_metrics`` gives the dataset back once, in order, and a few
training steps give the weights plain PyTorch gets on one process with the whole batch. Any failed check ends the
processes with an error, and the command with status 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.accelerator import Accelerator

__all__ = ["add_test_parser", "run_checks"]

_SUCCESS = "Test is a success! You are ready for your distributed training!"
_BATCH = 4  # per process
_STEPS = 4
_LR = 0.1


def add_test_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``test`` to ``commands``."""
    parser = commands.add_parser("test", help="Run a short self-check on the processes a config file describes.")
    parser.add_argument(
        "--config_file", default=None, help="The config to check (default: Accelerate's default file, if any)."
    )
    parser.set_defaults(handler=_run_test)


def _run_test(args: argparse.Namespace) -> int:
    if args.config_file is not None and not Path(args.config_file).is_file():
        raise FileNotFoundError(f"config file {args.config_file!r} does not exist; pass an existing --config_file")
    command = [sys.executable, "-m", "lightning_accel.cli", "launch"]
    if args.config_file is not None:
        command += ["--config_file", args.config_file]
    result = subprocess.run([*command, "--module", "lightning_accel.cli.selftest"], check=False)
    if result.returncode != 0:
        print(f"The self-check failed (exit status {result.returncode}); the processes' output says why.")
        return 1
    print(_SUCCESS)
    return 0


# ---------------------------------------------------------------------------------- what each process checks


def _check_processes(accelerator: Accelerator) -> str:
    import torch

    ranks = accelerator.gather(torch.tensor([accelerator.process_index], device=accelerator.device)).tolist()
    if ranks != list(range(accelerator.num_processes)):
        raise AssertionError(f"gathering the process indices gave {ranks}, expected 0..{accelerator.num_processes}")
    return f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, on {accelerator.device}"


def _check_data(accelerator: Accelerator) -> str:
    """An uneven dataset: the last batch wraps around on some processes; ``gather_for_metrics`` drops the copies."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    size = 3 * _BATCH * accelerator.num_processes + 1
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=_BATCH))
    seen = torch.cat([accelerator.gather_for_metrics(batch).cpu() for (batch,) in loader]).tolist()
    if seen != list(range(size)):
        raise AssertionError(f"gather_for_metrics over the prepared loader gave {seen}, expected 0..{size - 1}")
    return f"{size} samples sharded over the processes and gathered back once, in order"


def _model_and_data(num_processes: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(_STEPS * _BATCH * num_processes, 4, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, inputs, targets


def _reference_weights(num_processes: int) -> dict[str, Any]:
    """The same steps in plain PyTorch, one process, each step on the batches all processes share."""
    import torch

    model, inputs, targets = _model_and_data(num_processes)
    optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
    step = _BATCH * num_processes
    for start in range(0, len(inputs), step):
        loss = torch.nn.functional.mse_loss(model(inputs[start : start + step]), targets[start : start + step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach() for name, value in model.state_dict().items()}


def _check_training(accelerator: Accelerator) -> str:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    model, inputs, targets = _model_and_data(accelerator.num_processes)
    model = accelerator.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
    optimizer, loader = accelerator.prepare(optimizer, DataLoader(TensorDataset(inputs, targets), batch_size=_BATCH))
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    trained = accelerator.get_state_dict(model)  # gathered on the main process (sharded engines: there only)
    if not accelerator.is_main_process:
        return ""
    tolerance = 1e-5 if accelerator.mixed_precision == "no" else 5e-2
    for name, expected in _reference_weights(accelerator.num_processes).items():
        got = trained[name].detach().float().cpu()
        if not torch.allclose(got, expected, rtol=0, atol=tolerance):
            difference = (got - expected).abs().max().item()
            raise AssertionError(f"after training, {name} differs from plain PyTorch's by {difference:.3g}")
    return f"{_STEPS} training steps give plain PyTorch's weights (within {tolerance:g})"


def run_checks() -> None:
    """Run every check in this process of a launch; the main process prints what passed.

    Raises:
        AssertionError: Naming the first check that failed.

    """
    from lightning_accel import Accelerator

    accelerator = Accelerator()
    for check in (_check_processes, _check_data, _check_training):
        result = check(accelerator)
        accelerator.wait_for_everyone()
        if result:
            accelerator.print(f"ok: {result}")
    accelerator.print("All checks passed.")
    accelerator.end_training()


if __name__ == "__main__":
    run_checks()
