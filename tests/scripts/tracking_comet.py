"""Log the same values to offline Comet experiments through HF accelerate's and lightning_accel's shims.

``python tracking_comet.py OUT``: each framework writes its offline archive under ``OUT/<framework>``. Comet runs in
its own process because importing ``comet_ml`` hooks into other libraries.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import comet_ml


def run(framework: str, out: Path) -> None:
    """One offline experiment named ``framework`` in the project ``parity``."""
    package = importlib.import_module({"hf": "accelerate", "ours": "lightning_accel"}[framework])
    accelerator = package.Accelerator(cpu=True, log_with="comet_ml")
    config = comet_ml.ExperimentConfig(offline_directory=str(out / framework), name=framework)
    accelerator.init_trackers(
        "parity",
        config={"lr": 0.1, "epochs": 2, "optimizer": "sgd"},
        init_kwargs={"comet_ml": {"online": False, "experiment_config": config}},
    )
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello", "group": {"a": 1.0, "b": 2.0}}, step=2)
    accelerator.end_training()


if __name__ == "__main__":
    from tests.helpers import reset_accelerator_states

    for name in ("hf", "ours"):
        run(name, Path(sys.argv[1]))
        reset_accelerator_states()
