"""Per-step overhead of lightning_accel's ``acc_no`` strategy and ``Accelerator`` shim against raw PyTorch, Lightning's
own strategy and HF accelerate's ``Accelerator``.

Workload (shared/reference/benchmarks.md): ``Linear(64, 128) -> ReLU -> Linear(128, 1)``, SGD lr 1e-3, MSE loss,
batches of 32 random rows, one thread. Variants run interleaved in rounds inside one process, because these machines
are noisy: compare the printed ratios, never absolute times across runs.

    python benchmarks/overhead.py --rounds 5 --steps 400
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings
from collections.abc import Callable
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


def step_times(stamps: list[float], warmup: int) -> list[float]:
    deltas = [b - a for a, b in itertools.pairwise(stamps)]
    return deltas[warmup:]


def raw(steps: int, warmup: int) -> list[float]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    stamps = [time.perf_counter()]
    for x, y in make_loader(steps):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        stamps.append(time.perf_counter())
    return step_times(stamps, warmup)


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
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())


def trainer(strategy: str, devices: int = 1, **trainer_kwargs: Any) -> Callable[[int, int], list[float]]:
    def run(steps: int, warmup: int) -> list[float]:
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


def fabric(strategy: str) -> Callable[[int, int], list[float]]:
    def run(steps: int, warmup: int) -> list[float]:
        f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        net = make_net()
        model, opt = f.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3))
        stamps = [time.perf_counter()]
        for x, y in f.setup_dataloaders(make_loader(steps)):
            f.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            stamps.append(time.perf_counter())
        return step_times(stamps, warmup)

    return run


def accelerator(package: str) -> Callable[[int, int], list[float]]:
    """The Accelerate loop (``with accumulate: backward; step; zero_grad``) under ``package``'s ``Accelerator``."""

    def run(steps: int, warmup: int) -> list[float]:
        import importlib

        module = importlib.import_module(package)
        _reset_accelerator_states()
        acc = module.Accelerator(cpu=True)
        net = make_net()
        model, opt, data = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3), make_loader(steps))
        stamps = [time.perf_counter()]
        for x, y in data:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            stamps.append(time.perf_counter())
        return step_times(stamps, warmup)

    return run


def _reset_accelerator_states() -> None:
    from accelerate.state import AcceleratorState, GradientState

    from lightning_accel.state import reset_state

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    reset_state()


VARIANTS: dict[str, Callable[[int, int], list[float]]] = {
    "raw": raw,
    "trainer[single_device]": trainer("single_device"),
    "trainer[acc_no]": trainer("acc_no"),
    "fabric[auto]": fabric("auto"),
    "fabric[acc_no]": fabric("acc_no"),
    "accelerator[ours]": accelerator("lightning_accel"),
    "accelerator[hf]": accelerator("accelerate"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, run in VARIANTS.items():
            samples[name] += run(args.steps + args.warmup, args.warmup)
    base = statistics.median(samples["raw"])
    print(f"{'variant':<24}{'median us/step':>16}{'ratio to raw':>14}")
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:<24}{median * 1e6:>16.1f}{median / base:>14.3f}")
    acc = statistics.median(samples["trainer[acc_no]"]) / statistics.median(samples["trainer[single_device]"])
    print(f"acc_no / Lightning single_device (Trainer): {acc:.3f}  (target <= 1.05)")
    shim = statistics.median(samples["accelerator[ours]"])
    print(f"Accelerator shim / raw: {shim / base:.3f}  (target <= 1.10)")
    print(f"Accelerator shim / HF accelerate: {shim / statistics.median(samples['accelerator[hf]']):.3f}  (target < 1)")


if __name__ == "__main__":
    main()
