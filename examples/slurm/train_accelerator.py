"""An Accelerate-style training loop under SLURM that saves its state on SIGUSR1 / SIGTERM and resumes when requeued.

Started by ``srun`` (see ``accelerator.sbatch``): ``Accelerator()`` reads the processes from SLURM's variables
(``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_PROCID``) and forms one process group. The same script runs
under ``torchrun`` and ``lightning-accel launch`` too.

The pattern, in three parts:

1. :class:`Preemption` notes a SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``: 90 s before the time limit) or a SIGTERM
   (SLURM preempting or cancelling the job) in a flag, and nothing else: a signal handler runs between two Python
   lines, where no collective may start.
2. After each optimizer step, :meth:`Preemption.should_stop` turns the flag into ``set_trigger`` and asks
   ``check_trigger`` (one all-reduce), so every process stops after the same step, even one the signal missed.
   Every process then calls ``save_state()``; on SIGUSR1 process 0 runs ``scontrol requeue $SLURM_JOB_ID``.
3. On start, ``load_state(missing_ok=True, resume_position=True)`` starts a fresh run from nothing and a requeued
   one from the newest complete ``save_state`` folder (``ProjectConfiguration(automatic_checkpoint_naming=True)``):
   weights, optimizer, random states, the data loader's position and the step counter.

Tested by ``tests/launch/test_slurm.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed


class Progress:
    """The optimizer steps done, saved with the state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Preemption:
    """Notes SIGUSR1 and SIGTERM, and tells every process to stop after the same step."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.received: signal.Signals | None = None
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """Whether any process received a signal (a collective: call it at the same point on every process)."""
        if self.received is not None:
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()

    def requeue(self) -> None:
        """On SIGUSR1, put the job back in the queue (process 0); on SIGTERM SLURM decides (it preempts or cancels)."""
        if self.received != signal.SIGUSR1 or not self.accelerator.is_main_process:
            return
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
        subprocess.run(["scontrol", "requeue", job], check=True)
        self.accelerator.print(f"requeued SLURM job {job}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, required=True, help="project_dir: the save_state folders go here")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, help="where process 0 writes the final weights")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, after_step: Callable[[int], None] | None = None) -> None:
    args = parse_args(argv)
    set_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    preemption = Preemption(accelerator)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state(missing_ok=True, resume_position=True)  # the newest save_state folder, if any
    while progress.step < args.steps:
        for inputs, targets in loader:
            accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if after_step is not None:
                after_step(progress.step)
            if preemption.should_stop():
                accelerator.save_state()
                preemption.requeue()
                accelerator.end_training()
                return
            if progress.step == args.steps:
                break
    accelerator.print(f"trained {progress.step} steps on {accelerator.num_processes} processes")
    if args.out is not None and accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({name: value.clone() for name, value in weights.items()}, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
