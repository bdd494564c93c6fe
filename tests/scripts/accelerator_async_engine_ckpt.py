"""``save_state(async_save=True)`` under FSDP and DeepSpeed on 2 CPU processes, against a synchronous save.

``--phase compare`` (one launch): for each variant of ``accelerator_sharded_ckpt.py`` but DDP, run A trains 4 of 8
micro-batches, saves (``--out/{variant}/{sync,async}``, automatic naming), and trains the rest; the async run's
background write is held until the micro-batch after the call has stepped the weights, so the thread writes while
training goes on (FSDP's sharded saves run their collectives then, beside training's). Run B, from other initial
weights, resumes from the latest checkpoint of each and trains the last 4. Each rank writes ``{variant}_rank{r}.pt``.

``--phase kill``: a ~170 MB model saves ``checkpoint_0`` (under ``--out/killed_{variant}``), changes its weights, and
every process kills itself (SIGKILL) once the background write of ``checkpoint_1`` has begun. ``--phase after`` (one
launch, after the kills): for each ``--killed`` variant, what the kill left, a fresh run's (other initial weights)
``load_state()`` and its next ``save_state()`` (``after_kill_{variant}_rank{r}.pt``); then for each ``--failing``
variant, process 1's background write of ``checkpoint_1`` fails (file size limit), and what each process's next call
raised and what ``load_state()`` then loads go into ``failing_{variant}_rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_accel import Accelerator
from lightning_accel.checkpoint import background
from lightning_accel.state import reset_state
from lightning_accel.utils import ProjectConfiguration
from tests.scripts.accelerator_sharded_ckpt import VARIANTS, setup, train, weights

ASYNC_VARIANTS = [name for name in VARIANTS if name != "ddp"]
MICRO_BATCHES, SAVE_AFTER = 8, 4


class HeldWrites:
    """Holds each background save's write until :meth:`release` (the save itself is unchanged)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self._original = background.BackgroundSave.__init__
        held = self

        def init(save: background.BackgroundSave, write: Callable[[], None], *args: Any, **kwargs: Any) -> None:
            def later() -> None:
                held.gate.wait()
                held.started.set()
                write()

            held._original(save, later, *args, **kwargs)

        background.BackgroundSave.__init__ = init  # type: ignore[method-assign]

    def release(self) -> None:
        self.gate.set()


def naming(root: Path) -> dict[str, Any]:
    return {"project_config": ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)}


def run_a(variant: str, root: Path, async_save: bool, held: HeldWrites) -> dict[str, Any]:
    held.gate.clear()
    held.started.clear()
    accelerator, model, optimizer, scheduler, loader = setup(variant, seed=0, **naming(root))
    batches = iter(loader)
    train(accelerator, model, optimizer, scheduler, (next(batches) for _ in range(SAVE_AFTER)))
    saved = weights(accelerator, model)
    folder = accelerator.save_state(async_save=async_save)
    train(accelerator, model, optimizer, scheduler, [next(batches)])  # changes the weights before any write
    unwritten = not held.started.is_set()
    held.release()
    train(accelerator, model, optimizer, scheduler, batches)  # goes on while the thread writes
    final = weights(accelerator, model)
    accelerator.wait_for_checkpoint()
    return {"folder": folder, "saved": saved, "final": final, "unwritten_after_a_step": unwritten}


def run_b(variant: str, root: Path) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler, loader = setup(variant, seed=100, **naming(root))
    initial = weights(accelerator, model)
    loaded = accelerator.load_state(resume_position=True)
    train(accelerator, model, optimizer, scheduler, loader)
    return {"loaded": loaded, "initial": initial, "final": weights(accelerator, model), "lr": scheduler.get_last_lr()}


def compare(out: Path, variants: list[str]) -> None:
    held = HeldWrites()
    for variant in variants:
        result = {}
        for mode in ("sync", "async"):
            root = out / variant / mode
            result[mode] = {"a": run_a(variant, root, mode == "async", held), "b": run_b(variant, root)}
        torch.save(result, out / f"{variant}_rank{torch.distributed.get_rank()}.pt")


def big(variant: str, root: Path, seed: int) -> tuple[Accelerator, Any]:
    reset_state()
    accelerator = Accelerator(cpu=True, **VARIANTS[variant](), **naming(root))
    torch.manual_seed(seed)
    model: Any = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(40)])  # 168 MB of weights
    if variant.startswith("fsdp"):
        model = accelerator.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant.startswith("fsdp"):
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def kill(variant: str, root: Path) -> None:
    held = HeldWrites()
    held.release()
    accelerator, model = big(variant, root, seed=0)
    accelerator.save_state()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.save_state(async_save=True)
    held.started.wait()
    time.sleep(0.05)  # into the write
    os.kill(os.getpid(), signal.SIGKILL)


def failing(variant: str, root: Path, out: Path) -> None:
    """Process 1's background write fails (file size limit): the next call raises it on both, checkpoint_0 stays."""
    accelerator, model = big(variant, root, seed=0)
    accelerator.save_state()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if accelerator.process_index == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_384, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.save_state(async_save=True)  # returns; the write fails later
    raised = None
    try:
        accelerator.wait_for_checkpoint()
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    left = sorted(path.name for path in (root / "checkpoints").iterdir())
    accelerator.wait_for_everyone()
    loaded = accelerator.load_state()
    state = weights(accelerator, model)
    result = {"raised": raised, "left": left, "loaded": loaded, "weights": state}
    torch.save(result, out / f"failing_{variant}_rank{accelerator.process_index}.pt")


def after_kill(variant: str, root: Path, out: Path) -> None:
    accelerator, model = big(variant, root, seed=1)  # checkpoint_0 holds seed 0's weights
    left = sorted(path.name for path in (root / "checkpoints").iterdir())
    killed = root / "checkpoints" / ".checkpoint_1.incomplete"
    written = sorted(str(path.relative_to(killed)) for path in killed.rglob("*")) if killed.is_dir() else []
    accelerator.wait_for_everyone()
    loaded = accelerator.load_state()
    state = weights(accelerator, model)
    accelerator.save_state()
    after = sorted(path.name for path in (root / "checkpoints").iterdir())
    result = {"left": left, "written": written, "loaded": loaded, "weights": state, "after": after}
    torch.save(result, out / f"after_kill_{variant}_rank{accelerator.process_index}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=["compare", "kill", "after"], required=True)
    parser.add_argument("--variants", nargs="*", default=ASYNC_VARIANTS, help="compare: all; kill: the first")
    parser.add_argument("--killed", nargs="*", default=[], help="after: the variants a kill phase ran")
    parser.add_argument("--failing", nargs="*", default=[], help="after: the variants whose write is made to fail")
    args = parser.parse_args()
    if args.phase == "compare":
        compare(args.out, args.variants)
    elif args.phase == "kill":
        kill(args.variants[0], args.out / f"killed_{args.variants[0]}")
    else:
        for variant in args.killed:
            after_kill(variant, args.out / f"killed_{variant}", args.out)
        for variant in args.failing:
            failing(variant, args.out / f"failing_{variant}", args.out)
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
