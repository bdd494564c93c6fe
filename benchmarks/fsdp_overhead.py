"""Per-step time of ``acc_fsdp`` (Trainer) against a raw ``fully_shard`` loop, 2 CPU processes over gloo.

Same workload as ``overhead.py`` (``Linear(64, 128) -> ReLU -> Linear(128, 1)``, SGD, MSE, batches of 32), FSDP2 on
both sides, variants interleaved in rounds inside one run. Start it with::

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/fsdp_overhead.py --rounds 3 --steps 200
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

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from overhead import make_loader, make_net, step_times, trainer

import lightning_accel  # noqa: F401  (registers acc_fsdp)


def raw_fully_shard(steps: int, warmup: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    stamps = [time.perf_counter()]
    for x, y in make_loader(steps):
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        stamps.append(time.perf_counter())
    return step_times(stamps, warmup)


VARIANTS: dict[str, Callable[[int, int], list[float]]] = {
    "raw fully_shard": raw_fully_shard,
    # Every process feeds the same batches, as the raw loop does.
    "trainer[acc_fsdp]": trainer("acc_fsdp", devices=2, use_distributed_sampler=False),
    "trainer[ddp]": trainer("ddp", devices=2, use_distributed_sampler=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, run in VARIANTS.items():
            samples[name] += run(args.steps + args.warmup, args.warmup)
    if os.environ.get("RANK", "0") == "0":
        base = statistics.median(samples["raw fully_shard"])
        print(f"{'variant':<22}{'median us/step':>16}{'ratio to raw':>14}")
        for name, times in samples.items():
            median = statistics.median(times)
            print(f"{name:<22}{median * 1e6:>16.1f}{median / base:>14.3f}")
        ratio = statistics.median(samples["trainer[acc_fsdp]"]) / base
        print(f"acc_fsdp / raw fully_shard: {ratio:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
