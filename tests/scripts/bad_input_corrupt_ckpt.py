"""Resume from a corrupted checkpoint under each ``acc_*`` strategy given; write what each raised (JSON).

Run in one process (each strategy on one CPU device): ``python bad_input_corrupt_ckpt.py OUT STRATEGY...``; a
strategy written ``fabric:NAME`` is tried with ``Fabric.load`` instead of ``Trainer.fit(ckpt_path=...)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* strategies)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _resume(strategy: str, ckpt: Path) -> dict[str, str]:
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(Model(), data, ckpt_path=str(ckpt))
    except Exception as err:  # what a user sees
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": "none", "message": ""}


def _fabric_load(strategy: str, ckpt: Path) -> dict[str, str]:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Model())
    try:
        fabric.load(ckpt, {"model": model})
    except Exception as err:  # what a user sees
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": "none", "message": ""}


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    ckpt = out / "last.ckpt"
    torch.save({"state_dict": Model().state_dict(), "epoch": 0}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:200])  # cut short, as a save killed mid-write leaves it
    results = {
        strategy: _fabric_load(strategy.removeprefix("fabric:"), ckpt)
        if strategy.startswith("fabric:")
        else _resume(strategy, ckpt)
        for strategy in strategies
    }
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
