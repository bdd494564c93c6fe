"""Per-step time of ``acc_deepspeed`` (Trainer) against a raw ``deepspeed.initialize`` loop, 2 CPU processes over gloo.

Same workload as ``overhead.py`` (``Linear(64, 128) -> ReLU -> Linear(128, 1)``, SGD, MSE, batches of 32), the same
ZeRO stage and DeepSpeed config on both sides (the raw loop gets the config the strategy resolves), variants
interleaved in rounds inside one run. Start it with::

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/deepspeed_overhead.py --rounds 3 --steps 200
"""

from __future__ import annotations

import argparse
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
from overhead import BATCH, Module, Stamps, make_loader, make_net, step_times

import lightning_accel  # noqa: F401  (registers acc_deepspeed)
from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy
from lightning_accel.strategies.deepspeed_core import TrainingFacts, resolve_config


def raw_deepspeed(stage: int) -> Callable[[int, int], list[float]]:
    def run(steps: int, warmup: int) -> list[float]:
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
        stamps = [time.perf_counter()]
        for x, y in make_loader(steps):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            stamps.append(time.perf_counter())
        return step_times(stamps, warmup)

    return run


def trainer(strategy: Callable[[], Any]) -> Callable[[int, int], list[float]]:
    def run(steps: int, warmup: int) -> list[float]:
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
        t.fit(Module(), make_loader(steps))
        return step_times(stamps.stamps, warmup)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    variants: dict[str, Callable[[int, int], list[float]]] = {
        "raw deepspeed": raw_deepspeed(args.stage),
        "trainer[acc_deepspeed]": trainer(lambda: AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=args.stage))),
        "trainer[ddp]": trainer(lambda: "ddp"),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            samples[name] += run(args.steps + args.warmup, args.warmup)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    base = statistics.median(samples["raw deepspeed"])
    print(f"ZeRO stage {args.stage}, 2 processes, gloo")
    print(f"{'variant':<26}{'median us/step':>16}{'ratio to raw':>14}")
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:<26}{median * 1e6:>16.1f}{median / base:>14.3f}")
    ratio = statistics.median(samples["trainer[acc_deepspeed]"]) / base
    print(f"acc_deepspeed (Trainer) / raw deepspeed.initialize loop: {ratio:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
