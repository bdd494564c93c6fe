"""Per-step time of ``acc_deepspeed`` (Trainer) against a raw ``deepspeed.initialize`` loop, 2 CPU processes over gloo.

Same workload as ``overhead.py`` (``Linear(64, hidden) -> ReLU -> Linear(hidden, 1)`` with ``hidden=128``, SGD, MSE,
batches of 32), the same ZeRO stage and DeepSpeed config on both sides (the raw loop gets the config the strategy
resolves), variants interleaved in rounds inside one run. Lightning's ``ddp`` Trainer against a raw
``DistributedDataParallel`` loop runs alongside, to show what the Trainer's own loop costs per step on this machine
(what is left of the DeepSpeed excess beyond that is the strategy's). Wall time and process CPU time are both reported:
on a loaded machine the wall time of 2 processes is mostly waiting for the other rank. ``--hidden`` makes the step
heavier. Start it with::

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/deepspeed_overhead.py --rounds 3 --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from overhead import BATCH, Module, make_loader

import lightning_accel  # noqa: F401  (registers acc_deepspeed)
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy
from lightning_accel.strategies.deepspeed_core import TrainingFacts, resolve_config

HIDDEN = 128
Stamp = tuple[float, float]  # (wall, process CPU) seconds


def now() -> Stamp:
    return time.perf_counter(), time.process_time()


def step_times(stamps: list[Stamp], warmup: int) -> list[Stamp]:
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(stamps)]
    return deltas[warmup:]


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


class Stamps(L.Callback):
    def __init__(self) -> None:
        self.stamps: list[Stamp] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stamps.append(now())


def raw_ddp(steps: int, warmup: int) -> list[Stamp]:
    net = nn.parallel.DistributedDataParallel(make_net())
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    stamps = [now()]
    for x, y in make_loader(steps):
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        stamps.append(now())
    return step_times(stamps, warmup)


def raw_deepspeed(stage: int) -> Callable[[int, int], list[Stamp]]:
    def run(steps: int, warmup: int) -> list[Stamp]:
        import deepspeed
        import deepspeed.ops

        # As the strategy does: no JIT build of DeepSpeed's inference-only CPU all-reduce kernel.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed("gloo")
        facts = TrainingFacts(world_size=dist.get_world_size(), device_type="cpu", micro_batch_size=BATCH)
        config = resolve_config(DeepSpeedPlugin(zero_stage=stage).deepspeed_config, facts)
        net = make_net()
        engine: Any
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=1e-3),
            config=config,
            dist_init_required=False,
        )
        stamps = [now()]
        for x, y in make_loader(steps):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            stamps.append(now())
        return step_times(stamps, warmup)

    return run


def trainer(strategy: Callable[[], Any]) -> Callable[[int, int], list[Stamp]]:
    def run(steps: int, warmup: int) -> list[Stamp]:
        stamps = Stamps()
        t = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy(),
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[stamps],
        )
        t.fit(Module(make_net()), make_loader(steps))
        return step_times(stamps.stamps, warmup)

    return run


def main() -> None:
    global HIDDEN
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    args = parser.parse_args()
    HIDDEN = args.hidden
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    variants: dict[str, Callable[[int, int], list[Stamp]]] = {
        "raw deepspeed": raw_deepspeed(args.stage),
        "trainer[acc_deepspeed]": trainer(lambda: AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=args.stage))),
        "raw ddp": raw_ddp,
        "trainer[ddp]": trainer(lambda: "ddp"),
    }
    samples: dict[str, list[Stamp]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            samples[name] += run(args.steps + args.warmup, args.warmup)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    wall = {name: statistics.median(w for w, _ in times) for name, times in samples.items()}
    cpu = {name: statistics.median(c for _, c in times) for name, times in samples.items()}
    raw_of = {"raw deepspeed": "raw deepspeed", "trainer[acc_deepspeed]": "raw deepspeed"}
    raw_of.update({"raw ddp": "raw ddp", "trainer[ddp]": "raw ddp"})
    print(f"ZeRO stage {args.stage}, hidden {args.hidden}, 2 processes, gloo; medians per step, rank 0")
    print(f"{'variant':<24}{'wall us':>10}{'ratio':>8}{'excess us':>11}{'cpu us':>10}{'ratio':>8}{'excess us':>11}")
    for name, raw in raw_of.items():
        print(
            f"{name:<24}{wall[name] * 1e6:>10.0f}{wall[name] / wall[raw]:>8.3f}{(wall[name] - wall[raw]) * 1e6:>11.0f}"
            f"{cpu[name] * 1e6:>10.0f}{cpu[name] / cpu[raw]:>8.3f}{(cpu[name] - cpu[raw]) * 1e6:>11.0f}"
        )
    ratio = wall["trainer[acc_deepspeed]"] / wall["raw deepspeed"]
    print(f"acc_deepspeed (Trainer) / raw deepspeed.initialize loop, wall: {ratio:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
