"""Big-model inference in Lightning: ``Trainer.predict`` and Fabric on a model whose weights stay on disk.

A synthetic residual MLP is written as a sharded safetensors checkpoint (one shard per block, as Hugging Face
checkpoints are sharded). The LightningModule builds it on the meta device in ``configure_model`` and loads it with
``load_checkpoint_and_dispatch``: with a CPU budget smaller than the model, most blocks go to ``"disk"`` (memory-mapped
files in the offload folder) and are read for their call only. ``strategy="acc_device_map"`` leaves that placement
alone (Lightning's single-device strategies would move the whole module) and refuses ``Trainer.fit``::

    python examples/big_model_inference.py                    # offloaded predict == in-memory predict, + Fabric
    python examples/big_model_inference.py --workdir w --mode checkpoint      # only write the checkpoint
    python examples/big_model_inference.py --workdir w --mode offload --report rss.json  # peak RSS as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import tempfile
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import init_empty_weights, load_checkpoint_and_dispatch
from lightning_accel.utils import SAFE_WEIGHTS_INDEX_NAME, convert_file_size_to_int


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) / 4


class BigMLP(nn.Module):
    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def write_checkpoint(folder: Path, hidden: int, blocks: int) -> int:
    """A sharded checkpoint of synthetic weights, one block in memory at a time; returns the model's bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(blocks + 1):
        prefix, shape = (f"blocks.{index}", (hidden, hidden)) if index < blocks else ("head", (8, hidden))
        names = ("up", "down") if index < blocks else ("",)
        tensors = {}
        for name in names:
            key = f"{prefix}.{name}" if name else prefix
            tensors[f"{key}.weight"] = torch.randn(shape, generator=generator) / hidden**0.5
            tensors[f"{key}.bias"] = torch.randn(shape[0], generator=generator) / 10
        shard = f"model-{index:05d}.safetensors"
        save_file(tensors, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index_file))
    return total


class BigModelPredictor(L.LightningModule):
    """Builds the model without memory and dispatches it, when the Trainer calls ``configure_model``."""

    def __init__(self, checkpoint: Path, hidden: int, blocks: int, offload_folder: Path | None, cpu_budget: str):
        super().__init__()
        self.checkpoint, self.hidden, self.blocks = checkpoint, hidden, blocks
        self.offload_folder, self.cpu_budget = offload_folder, cpu_budget
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with init_empty_weights():
            model = BigMLP(self.hidden, self.blocks)
        if self.offload_folder is None:  # the whole model in memory (the comparison)
            self.model = load_checkpoint_and_dispatch(model, str(self.checkpoint), device_map={"": "cpu"})
            return
        self.model = load_checkpoint_and_dispatch(
            model, str(self.checkpoint), device_map="auto", max_memory={"cpu": self.cpu_budget},
            no_split_module_classes=["Block"], offload_folder=str(self.offload_folder),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(x)

    def predict_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self(batch[0])

    def training_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def inputs(hidden: int, samples: int = 16) -> DataLoader:
    data = torch.randn(samples, hidden, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(data), batch_size=4)


def trainer() -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy="acc_device_map", logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip


def predict(workdir: Path, hidden: int, blocks: int, offload: bool, cpu_budget: str) -> torch.Tensor:
    offload_folder = workdir / "offload" if offload else None
    module = BigModelPredictor(workdir / "checkpoint", hidden, blocks, offload_folder, cpu_budget)
    predictions = trainer().predict(module, inputs(hidden))
    assert predictions is not None
    return torch.cat(predictions)  # type: ignore[arg-type]


def fabric_predict(workdir: Path, hidden: int, blocks: int, cpu_budget: str) -> torch.Tensor:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_device_map")
    with fabric.init_module(empty_init=True), init_empty_weights():
        model = BigMLP(hidden, blocks)
    model = load_checkpoint_and_dispatch(
        model, str(workdir / "checkpoint"), device_map="auto", max_memory={"cpu": cpu_budget},
        no_split_module_classes=["Block"], offload_folder=str(workdir / "fabric_offload"),
    )  # fmt: skip
    model = fabric.setup_module(model, move_to_device=False)  # the map placed it (acc_device_map would not move it)
    loader = fabric.setup_dataloaders(inputs(hidden), use_distributed_sampler=False)
    with torch.inference_mode():
        return torch.cat([model(batch[0]) for batch in loader])


def reset_peak_rss() -> None:
    """Start the peak over from the current resident memory (Linux: ``/proc/self/clear_refs``), if possible."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak resident memory since :func:`reset_peak_rss` (Linux ``VmHWM``; elsewhere the process's peak)."""
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        (line,) = [entry for entry in status if entry.startswith("VmHWM:")]
        return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def current_rss_bytes() -> int:
    """Resident memory now (Linux ``/proc``; elsewhere the peak so far, which can only overstate it)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return peak_rss_bytes()
    return pages * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint and offload files go")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--cpu-budget", default="1MB", help="CPU memory the device map may use; the rest is disk")
    parser.add_argument("--mode", choices=["both", "offload", "full", "checkpoint"], default="both")
    parser.add_argument("--report", type=Path, default=None, help="write peak RSS (and sizes) as JSON")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="big_model_"))
    checkpoint = workdir / "checkpoint"
    if not (checkpoint / SAFE_WEIGHTS_INDEX_NAME).exists():
        write_checkpoint(checkpoint, args.hidden, args.blocks)
    if args.mode == "checkpoint":  # only write it (so that a measuring run starts without the writing's peak)
        return
    size = json.loads((checkpoint / SAFE_WEIGHTS_INDEX_NAME).read_text())["metadata"]["total_size"]
    print(f"model: {size / 2**20:.1f} MiB in {args.blocks + 1} shards; CPU budget {args.cpu_budget}")
    report: dict[str, float] = {"model_bytes": size, "cpu_budget_bytes": convert_file_size_to_int(args.cpu_budget)}
    reset_peak_rss()  # what imports and reading the index used before this point is not the run's
    report["rss_before_bytes"] = current_rss_bytes()
    if args.mode == "both":
        offloaded = predict(workdir, args.hidden, args.blocks, True, args.cpu_budget)
        full = predict(workdir, args.hidden, args.blocks, False, args.cpu_budget)
        fabric = fabric_predict(workdir, args.hidden, args.blocks, args.cpu_budget)
        assert torch.allclose(offloaded, full, atol=1e-6), "offloaded predictions differ from the in-memory ones"
        assert torch.allclose(fabric, full, atol=1e-6), "Fabric's predictions differ from the in-memory ones"
        print(f"Trainer.predict (disk offload) == in-memory predict == Fabric, {len(full)} samples")
    else:
        predict(workdir, args.hidden, args.blocks, args.mode == "offload", args.cpu_budget)
    report["rss_peak_bytes"] = peak_rss_bytes()
    print(f"peak RSS growth: {(report['rss_peak_bytes'] - report['rss_before_bytes']) / 2**20:.1f} MiB")
    if args.report is not None:
        args.report.write_text(json.dumps(report))
    if args.workdir is None:
        print(f"files under {workdir} (remove with: rm -r {os.fspath(workdir)})")


if __name__ == "__main__":
    main()
