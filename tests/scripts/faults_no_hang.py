"""One failure on one process, run under ``torch.distributed.run`` (2 CPU processes): every process must raise it.

``--cases`` lists the failures to try, one after the other in the same processes (each case that raises on every
process leaves them in step for the next). For each, every process records ``<type>: <message>`` for the exception
it got (or ``no error``) in ``$FAULTS_DIR/results_<rank>.json``; the script exits 0. Before these failures were
shared, the other process sat in the next collective until the process group's timeout (30 s here).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.config import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from lightning_accel.tracking import GeneralTracker, register_tracker_class
from tests.helpers import reset_accelerator_states

RANK = int(os.environ.get("RANK", "0"))
SHORT_TIMEOUT = [InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=30))]


class FailingAt(Dataset):
    """Sample ``i`` is ``[i]``, except sample ``bad``, which raises (as a corrupt record would)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise ValueError(f"record {index} is corrupt")
        return torch.tensor([float(index)])


def save_model_bad_size(directory: Path) -> None:
    accelerator = Accelerator(cpu=True, kwargs_handlers=SHORT_TIMEOUT)
    model = accelerator.prepare(nn.Linear(2, 2))
    accelerator.save_model(model, directory, max_shard_size="10XB")
    accelerator.wait_for_everyone()


def dispatcher_dataset_error(directory: Path) -> None:
    config = DataLoaderConfiguration(dispatch_batches=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config, kwargs_handlers=SHORT_TIMEOUT)
    loader = accelerator.prepare(DataLoader(FailingAt(16, bad=5), batch_size=2))
    for _ in loader:
        pass
    accelerator.wait_for_everyone()


class StrictTracker(GeneralTracker):
    """A user's tracker whose constructor takes the run name only."""

    name = "strict"
    requires_logging_directory = False

    def __init__(self, run_name: str) -> None:
        super().__init__()
        self.run_name = run_name

    @property
    def tracker(self) -> Any:
        return None


def init_trackers_bad_kwargs(directory: Path) -> None:
    register_tracker_class(StrictTracker)
    accelerator = Accelerator(cpu=True, log_with="strict", kwargs_handlers=SHORT_TIMEOUT)
    accelerator.init_trackers("run", init_kwargs={"strict": {"no_such_option": 1}})
    accelerator.wait_for_everyone()


def main_process_first_error(directory: Path) -> None:
    accelerator = Accelerator(cpu=True, kwargs_handlers=SHORT_TIMEOUT)
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            raise OSError("the download failed")
    accelerator.wait_for_everyone()


def rotation_manager_error(directory: Path) -> None:
    import lightning as L

    from lightning_accel.callbacks import CheckpointRotation

    class FailingRotation(CheckpointRotation):
        """Rotation whose deletion fails on rank 0 (a read-only or vanished file, say)."""

        def _rotate(self) -> None:
            raise PermissionError("cannot delete the old checkpoint")

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rotation = FailingRotation(
        ProjectConfiguration(directory, automatic_checkpoint_naming=True, total_limit=1), every_n_train_steps=1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="acc_multi_cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        callbacks=[rotation],
    )
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))


CASES: dict[str, Callable[[Path], None]] = {
    "save_model_bad_size": save_model_bad_size,
    "dispatcher_dataset_error": dispatcher_dataset_error,
    "init_trackers_bad_kwargs": init_trackers_bad_kwargs,
    "main_process_first_error": main_process_first_error,
    "rotation_manager_error": rotation_manager_error,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated: " + ", ".join(CASES))
    args = parser.parse_args()
    root = Path(os.environ.get("FAULTS_DIR") or tempfile.mkdtemp())
    results: dict[str, str] = {}
    for case in args.cases.split(","):
        try:
            CASES[case](root / case)
            outcome = "no error"
        except Exception as err:
            outcome = f"{type(err).__name__}: {err}"
        results[case] = outcome
        (root / f"results_{RANK}.json").write_text(json.dumps(results))
        reset_accelerator_states()


if __name__ == "__main__":
    main()
