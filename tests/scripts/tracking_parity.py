"""Log the same values to wandb (offline) and MLflow (file store) through HF accelerate's or lightning_accel's shim.

``python tracking_parity.py hf|ours`` (or under torchrun), or :func:`run` in-process; the caller sets
``WANDB_MODE=offline``, ``WANDB_DIR`` and ``MLFLOW_TRACKING_URI``. Only the main process may create runs.
"""

from __future__ import annotations

import importlib
import sys


def run(framework: str, check_lazy: bool = False) -> None:
    """Train-loop logging under ``accelerate`` (``"hf"``) or ``lightning_accel`` (``"ours"``).

    With ``check_lazy`` (a fresh process), check that no tracker package is imported before ``init_trackers``, and
    none at all on the other processes.
    """
    package = importlib.import_module({"hf": "accelerate", "ours": "lightning_accel"}[framework])
    accelerator = package.Accelerator(cpu=True, log_with=["wandb", "mlflow"])
    if check_lazy:
        assert not {"wandb", "mlflow"} & set(sys.modules), "tracker packages imported before init_trackers"
    accelerator.init_trackers(
        "parity",
        config={"lr": 0.1, "epochs": 2, "optimizer": "sgd"},
        init_kwargs={"wandb": {"name": framework}, "mlflow": {"run_name": framework}},
    )
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello"}, step=2)
    accelerator.log({"loss": 0.125})  # no step: wandb adds it to the open step 2 row, mlflow logs it at step 0
    accelerator.end_training()
    if check_lazy and not accelerator.is_main_process:
        assert not {"wandb", "mlflow"} & set(sys.modules), "tracker packages imported on another process"


if __name__ == "__main__":
    run(sys.argv[1], check_lazy=True)
