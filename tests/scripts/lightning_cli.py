"""``LightningCLI`` over lightning_accel's strategies and callbacks, run as a user runs it.

``python tests/scripts/lightning_cli.py fit|validate|test|predict --config ... [--trainer.* ...]`` with the
LightningModule of ``tests/scripts/entry_points.py``. :class:`RecordValidation` (given by ``class_path`` like any other
callback) appends each validation's ``val_loss`` to a JSON-lines file, so that a test can compare runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_accel  # noqa: F401  (registers the acc_* names)
from tests.scripts.entry_points import Classifier


class RecordValidation(L.Callback):
    """Append ``{"fn", "global_step", "val_loss"}`` of every validation to ``path`` (global rank 0).

    Args:
        path: The JSON-lines file.

    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            record = {
                "fn": trainer.state.fn.value if trainer.state.fn is not None else None,
                "global_step": trainer.global_step,
                "val_loss": float(trainer.callback_metrics["val_loss"]),
            }
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    LightningCLI(Classifier, save_config_kwargs={"overwrite": True})
