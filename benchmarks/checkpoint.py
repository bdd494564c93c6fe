"""How long a checkpoint blocks training: raw ``torch.save``, HF accelerate's ``save_state``, ours (sync and async).

Workload (issue 33): 60M parameters (15 ``Linear(2000, 2000)``) with AdamW's state after one step, about 705 MB on
disk. Every round saves once with each variant, in turn, into a fresh folder, so that neighbouring saves meet the same
machine (these machines are noisy; only ratios inside one run are compared). The time is what the training loop waits
for: the whole call for the synchronous variants, the call alone for ``save_state(async_save=True)`` (which returns
once the state is copied into host memory); ``wait_for_checkpoint`` (the background write) is timed apart and not
counted. Our synchronous save is timed with each manifest checksum: CRC-32 (the default), sha256, and sizes only
(``checksum=None``), the checksums computed while the files are written. Before each save the page cache is
written back (``os.sync``), so that no save pays for its predecessors' dirty pages. Medians over the rounds are printed,
and each variant's ratio to raw ``torch.save``.

    python benchmarks/checkpoint.py --rounds 5
    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --rounds 5     # DDP: the main process writes the files
    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --rounds 3 --engine fsdp_sharded

``--engine`` (``fsdp_full``, ``fsdp_sharded``: FSDP2 with that state-dict type; ``zero2``, ``zero3``: DeepSpeed) times
ours alone, synchronous and async, under that engine (whose gathers are in the async call too), with ratios to our
synchronous save.

Run it from the repository root with ``PYTHONPATH=.`` (a script's own folder comes first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import lightning_accel
from lightning_accel.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

ENGINES: dict[str, Callable[[], dict[str, object]]] = {
    "fsdp_full": lambda: {"fsdp_plugin": FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT")},
    "fsdp_sharded": lambda: {"fsdp_plugin": FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")},
    "zero2": lambda: {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)},
    "zero3": lambda: {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=3)},
}


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(15)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 2000)).sum().backward()
    optimizer.step()
    return model, optimizer


def _variants(root: Path) -> dict[str, Callable[[Path], float | None]]:
    import accelerate

    hf = accelerate.Accelerator(cpu=True)
    ours = lightning_accel.Accelerator(cpu=True)
    model, optimizer = _model_and_optimizer()
    hf.prepare(*_model_and_optimizer())  # HF keeps what it prepared and saves that
    ours.prepare(model, optimizer)
    main = ours.is_main_process

    def raw(folder: Path) -> None:
        if main:
            folder.mkdir()
            torch.save(model.state_dict(), folder / "model.bin")
            torch.save(optimizer.state_dict(), folder / "optimizer.bin")

    return {
        "raw torch.save": raw,
        "hf save_state": lambda folder: hf.save_state(folder) and None,
        "ours sync (crc32)": lambda folder: ours.save_state(folder) and None,
        "ours sync (sha256)": lambda folder: ours.save_state(folder, checksum="sha256") and None,
        "ours sync (sizes only)": lambda folder: ours.save_state(folder, checksum=None) and None,
        "ours async (blocked)": lambda folder: ours.save_state(folder, async_save=True) and None,
        "ours async (background)": lambda folder: _timed(ours.wait_for_checkpoint),
    }


def _engine_variants(engine: str) -> dict[str, Callable[[Path], float | None]]:
    """Ours under ``engine``: the same model, with AdamW's state after one step taken through the engine."""
    ours = lightning_accel.Accelerator(cpu=True, **ENGINES[engine]())
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(15)])
    if engine.startswith("fsdp"):  # FSDP shards first; the optimizer takes the sharded parameters
        model = ours.prepare(model)
        optimizer = ours.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        model, optimizer = ours.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ours.backward(model(torch.randn(4, 2000)).sum())
    optimizer.step()
    return {
        "ours sync": lambda folder: ours.save_state(folder) and None,
        "ours async (blocked)": lambda folder: ours.save_state(folder, async_save=True) and None,
        "ours async (background)": lambda folder: _timed(ours.wait_for_checkpoint),
    }


def _timed(function: Callable[[], None]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--engine", choices=sorted(ENGINES), default=None, help="ours alone, under this engine")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-bench-"))
    variants = _variants(root) if args.engine is None else _engine_variants(args.engine)
    times: dict[str, list[float]] = {name: [] for name in variants}
    rank = int(os.environ.get("RANK", "0"))
    for round_index in range(args.rounds):
        for index, (name, save) in enumerate(variants.items()):
            folder = root / f"r{round_index}-{index}"
            if not name.endswith("(background)"):  # a save starts with no dirty pages (the kernel's writeback
                os.sync()  # throttling meets none); the background write is timed where the async call left it
            torch.distributed.barrier() if torch.distributed.is_initialized() else None
            start = time.perf_counter()
            measured = save(folder)
            elapsed = time.perf_counter() - start
            times[name].append(measured if measured is not None else elapsed)
        for entry in root.iterdir():
            if rank == 0 and entry.name.startswith(f"r{round_index}-"):
                shutil.rmtree(entry, ignore_errors=True)
    if rank == 0:
        reference = "raw torch.save" if args.engine is None else "ours sync"
        raw = statistics.median(times[reference])
        world = int(os.environ.get("WORLD_SIZE", "1"))
        under = "" if args.engine is None else f", {args.engine}"
        print(f"{world} process(es){under}, {args.rounds} rounds, median seconds (ratio to {reference}):")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:26s} {median:7.3f} s  ({median / raw:5.2f}x)")
    shutil.rmtree(root, ignore_errors=True) if rank == 0 and args.dir is None else None


if __name__ == "__main__":
    main()
