"""Run ``examples/slurm/train_<kind>.py``, pausing once where the test sends the job its SIGUSR1.

    python tests/scripts/slurm_example.py trainer|accelerator [--pause-at N --ready DIR] -- <the example's arguments>

With ``--pause-at``, each process writes ``DIR/ready_<rank>`` at a fixed point (the Trainer: the end of epoch ``N``;
the loop: after step ``N``) and waits for a signal, so that the signal lands at the same point of training on every
process and the resumed run can match an uninterrupted one bit for bit. After the signal the Trainer keeps waiting
(SLURM ends a requeued job; here the test kills it); the loop goes on to its own save-and-stop.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L

EXAMPLES = Path(__file__).parent.parent.parent / "examples" / "slurm"


def _wait_for_signal(ready: Path, rank: int) -> None:
    ready.mkdir(parents=True, exist_ok=True)
    (ready / f"ready_{rank}").write_text(str(os.getpid()))
    signal.pause()  # returns once a handler (Lightning's, or the example's) has run


class PauseAtEpochEnd(L.Callback):
    def __init__(self, epoch: int, ready: Path) -> None:
        self.epoch = epoch
        self.ready = ready

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            _wait_for_signal(self.ready, trainer.global_rank)
            time.sleep(300)  # Lightning saved and requeued in its handler; the job now waits to be ended


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("trainer", "accelerator"))
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("example_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    example = runpy.run_path(str(EXAMPLES / f"train_{args.kind}.py"), run_name="slurm_example")
    argv = [arg for arg in args.example_args if arg != "--"]
    hooks: dict[str, Any] = {}
    if args.pause_at is not None and args.kind == "trainer":
        hooks["callbacks"] = [PauseAtEpochEnd(args.pause_at, args.ready)]
    elif args.pause_at is not None:
        rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))

        def after_step(step: int) -> None:
            if step == args.pause_at:
                _wait_for_signal(args.ready, rank)

        hooks["after_step"] = after_step
    example["main"](argv, **hooks)


if __name__ == "__main__":
    main()
