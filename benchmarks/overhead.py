"""Per-step overhead of lightning_accel's ``acc_no`` strategy and ``Accelerator`` shim against raw PyTorch, Lightning's
own strategy and HF accelerate's ``Accelerator``.

Workload (shared/reference/benchmarks.md): ``Linear(64, 128) -> ReLU -> Linear(128, 1)``, SGD lr 1e-3, MSE loss,
batches of 32 random rows, one thread. These machines are noisy, so the variants are compared inside one process and
never across runs: the loops we write ourselves (raw PyTorch, Fabric, both ``Accelerator`` classes) advance in
lockstep, one step of each in turn, so neighbouring steps of two variants meet the same machine; the Trainer variants,
whose loop Lightning owns, run one after the other in each round.

Each step is timed twice: wall time (``perf_counter``) and the CPU time of the training thread (``thread_time``).
A ratio is taken per round (a variant's median step over the reference's median step in the same round) and the
median over the rounds is printed.

    python benchmarks/overhead.py --rounds 7 --steps 300
    python benchmarks/overhead.py --variants raw,accelerator[ours]     # the shim against raw PyTorch only

Run it from the repository root with ``PYTHONPATH=.`` (or an installed checkout): a script's own folder comes first
on ``sys.path``, so an editable install elsewhere would otherwise be what ``import lightning_accel`` measures.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers acc_no)

BATCH = 32


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))


def make_loader(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * BATCH, 64, generator=g), torch.randn(steps * BATCH, 1, generator=g))
    return DataLoader(data, batch_size=BATCH)


Stamp = tuple[float, float]  # (wall, thread CPU) seconds
Loop = Callable[[int], Iterator[None]]  # a training loop of so many steps that yields after each one


def stamp() -> Stamp:
    return time.perf_counter(), time.thread_time()


def step_times(stamps: list[Stamp], warmup: int) -> list[Stamp]:
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(stamps)]
    return deltas[warmup:]


def raw(steps: int) -> Iterator[None]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for x, y in make_loader(steps):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


class Module(L.LightningModule):
    def __init__(self, net: nn.Module | None = None) -> None:
        super().__init__()
        self.net = make_net() if net is None else net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Stamps(L.Callback):
    def __init__(self) -> None:
        self.stamps: list[Stamp] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stamps.append(stamp())


def trainer(strategy: str, devices: int = 1, **trainer_kwargs: Any) -> Callable[[int, int], list[Stamp]]:
    """A Trainer run of ``strategy`` (Lightning owns the loop, so Trainer variants run one after the other)."""

    def run(steps: int, warmup: int) -> list[Stamp]:
        stamps = Stamps()
        t = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[stamps],
            **trainer_kwargs,
        )
        t.fit(Module(), make_loader(steps))
        return step_times(stamps.stamps, warmup)

    return run


def fabric(strategy: str) -> Loop:
    def loop(steps: int) -> Iterator[None]:
        f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        net = make_net()
        model, opt = f.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3))
        for x, y in f.setup_dataloaders(make_loader(steps)):
            f.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            yield

    return loop


def accelerator(package: str) -> Loop:
    """The Accelerate loop (``with accumulate: backward; step; zero_grad``) under ``package``'s ``Accelerator``."""

    def loop(steps: int) -> Iterator[None]:
        module = importlib.import_module(package)
        acc = module.Accelerator(cpu=True)
        net = make_net()
        model, opt, data = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3), make_loader(steps))
        for x, y in data:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            yield

    return loop


def lockstep(loops: dict[str, Loop], steps: int, warmup: int) -> dict[str, list[Stamp]]:
    """Run ``loops`` step by step in turn (the order rotating each step) and time each variant's steps.

    Consecutive steps of different variants meet the same state of the machine, so their ratio is steady even when
    the machine is not.
    """
    _reset_accelerator_states()
    running = {name: make(steps + warmup) for name, make in loops.items()}
    times: dict[str, list[Stamp]] = {name: [] for name in loops}
    order = list(loops)
    for step in range(steps + warmup):
        order = order[1:] + order[:1]
        for name in order:
            before = stamp()
            next(running[name])
            after = stamp()
            if step >= warmup:
                times[name].append((after[0] - before[0], after[1] - before[1]))
    return times


def _reset_accelerator_states() -> None:
    from accelerate.state import AcceleratorState, GradientState

    from lightning_accel.state import reset_state

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    reset_state()


LOOPS: dict[str, Loop] = {
    "raw": raw,
    "fabric[auto]": fabric("auto"),
    "fabric[acc_no]": fabric("acc_no"),
    "accelerator[ours]": accelerator("lightning_accel"),
    "accelerator[hf]": accelerator("accelerate"),
}
TRAINERS: dict[str, Callable[[int, int], list[Stamp]]] = {
    "trainer[single_device]": trainer("single_device"),
    "trainer[acc_no]": trainer("acc_no"),
}


def _round_ratios(rounds: list[dict[str, list[Stamp]]], name: str, base: str, clock: int) -> list[float]:
    """Each round's ratio of ``name``'s median step time over ``base``'s."""
    return [statistics.median(s[clock] for s in r[name]) / statistics.median(s[clock] for s in r[base]) for r in rounds]


def _round_ratio(rounds: list[dict[str, list[Stamp]]], name: str, base: str, clock: int) -> float:
    """The median over rounds of ``name``'s median step time over ``base``'s in the same round."""
    return statistics.median(_round_ratios(rounds, name, base, clock))


def report(rounds: list[dict[str, list[Stamp]]]) -> None:
    """Print each variant's median step (wall and thread CPU) and the per-round ratios the targets are about."""
    print(f"{'variant':<24}{'wall us/step':>14}{'wall ratio':>12}{'cpu us/step':>13}{'cpu ratio':>11}")
    for name in rounds[0]:
        wall = statistics.median(s[0] for r in rounds for s in r[name])
        cpu = statistics.median(s[1] for r in rounds for s in r[name])
        print(
            f"{name:<24}{wall * 1e6:>14.1f}{_round_ratio(rounds, name, 'raw', 0):>12.3f}"
            f"{cpu * 1e6:>13.1f}{_round_ratio(rounds, name, 'raw', 1):>11.3f}"
        )
    targets = [
        ("acc_no / Lightning single_device (Trainer)", "trainer[acc_no]", "trainer[single_device]", "<= 1.05"),
        ("Accelerator shim / raw", "accelerator[ours]", "raw", "<= 1.05"),
        ("Accelerator shim / HF accelerate", "accelerator[ours]", "accelerator[hf]", "< 1"),
    ]
    for label, name, base, target in targets:
        if name not in rounds[0] or base not in rounds[0]:
            continue
        wall, cpu = (_round_ratio(rounds, name, base, clock) for clock in (0, 1))
        per_round = _round_ratios(rounds, name, base, 0)
        print(
            f"{label}: wall {wall:.3f}, cpu {cpu:.3f}  (target {target}; wall per round"
            f" {min(per_round):.3f}-{max(per_round):.3f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument(
        "--variants",
        default=",".join([*LOOPS, *TRAINERS]),
        help="comma-separated variants to run (default all; raw is always run, the ratios' reference)",
    )
    args = parser.parse_args()
    chosen = {"raw", *args.variants.split(",")}
    unknown = chosen - {*LOOPS, *TRAINERS}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {[*LOOPS, *TRAINERS]}")
    loops = {name: loop for name, loop in LOOPS.items() if name in chosen}
    trainers = {name: run for name, run in TRAINERS.items() if name in chosen}
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rounds = []
    for _ in range(args.rounds):
        times = lockstep(loops, args.steps, args.warmup)
        times.update({name: run(args.steps + args.warmup, args.warmup) for name, run in trainers.items()})
        rounds.append(times)
    report(rounds)


if __name__ == "__main__":
    main()
