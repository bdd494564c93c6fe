"""Log the same run to Aim, ClearML, DVCLive, SwanLab and Trackio through HF accelerate's and lightning_accel's shims.

``python tracking_more.py OUT TRACKER...``: for each tracker and each framework (``hf``, then ``ours``), one short run
written under ``OUT/<tracker>``, all offline. The caller sets ``CLEARML_OFFLINE_MODE=1``, ``CLEARML_CACHE_DIR`` and
``TRACKIO_DIR`` (read when those packages are imported). Each run also checks that ``get_tracker(name, unwrap=True)``
is the package's own run object, and ClearML's writes where its offline session went to ``OUT/clearml/<framework>``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CONFIG = {"lr": 0.1, "epochs": 2, "optimizer": "sgd"}
IMAGE = np.tile(np.arange(16, dtype=np.uint8).reshape(4, 4, 1) * 16, (1, 1, 3))


def _accelerator(framework: str, name: str, **kwargs: Any) -> Any:
    package = importlib.import_module({"hf": "accelerate", "ours": "lightning_accel"}[framework])
    return package.Accelerator(cpu=True, log_with=name, **kwargs)


def run_aim(framework: str, out: Path) -> None:
    import aim

    accelerator = _accelerator(framework, "aim", project_dir=str(out / framework))
    accelerator.init_trackers("parity", config=CONFIG, init_kwargs={"aim": {"system_tracking_interval": None}})
    assert isinstance(accelerator.get_tracker("aim", unwrap=True), aim.Run)
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25}, step=2)
    accelerator.get_tracker("aim").log_images({"img": (IMAGE, "ramp")}, step=1)
    accelerator.end_training()


def run_clearml(framework: str, out: Path) -> None:
    from clearml import Task

    accelerator = _accelerator(framework, "clearml")
    # No repository scan (ours is called from a git checkout, HF's from site-packages), no hooks, no monitoring thread.
    quiet = {
        "auto_connect_frameworks": {"detect_repository": False, "pytorch": False, "tensorboard": False},
        "auto_resource_monitoring": False,
        "auto_connect_streams": False,
    }
    accelerator.init_trackers("parity", config=CONFIG, init_kwargs={"clearml": {"task_name": framework, **quiet}})
    task = accelerator.get_tracker("clearml", unwrap=True)
    assert isinstance(task, Task) and task.get_offline_mode_folder() is not None
    accelerator.log({"loss": 0.5, "eval_acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello"}, step=2)
    accelerator.log({"final": 0.125})
    tracker = accelerator.get_tracker("clearml")
    tracker.log_table("preds", columns=["x", "y"], data=[[1, 2], [3, 4]], step=3)
    tracker.log_images({"eval_img": IMAGE}, step=1)
    (out / framework).write_text(str(task.get_offline_mode_folder()))
    accelerator.end_training()


def run_dvclive(framework: str, out: Path) -> None:
    from dvclive import Live

    accelerator = _accelerator(framework, "dvclive")
    live_kwargs = {"dir": str(out / framework), "save_dvc_exp": False, "dvcyaml": None}
    accelerator.init_trackers("parity", config=CONFIG, init_kwargs={"dvclive": live_kwargs})
    assert isinstance(accelerator.get_tracker("dvclive", unwrap=True), Live)
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25})
    accelerator.log({"loss": 0.125}, step=5)
    accelerator.end_training()


def run_swanlab(framework: str, out: Path) -> None:
    accelerator = _accelerator(framework, "swanlab")
    init = {"mode": "offline", "log_dir": str(out / framework), "name": framework}
    accelerator.init_trackers("parity", config=CONFIG, init_kwargs={"swanlab": init})
    assert type(accelerator.get_tracker("swanlab", unwrap=True)).__name__ == "Run"
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25}, step=2)
    accelerator.get_tracker("swanlab").log_images({"img": [IMAGE]}, step=3)
    accelerator.end_training()


def run_trackio(framework: str, out: Path) -> None:
    from trackio.run import Run

    assert Path(os.environ["TRACKIO_DIR"]) == out
    accelerator = _accelerator(framework, "trackio")
    init = {"name": framework, "auto_log_cpu": False, "auto_log_gpu": False}
    accelerator.init_trackers("parity", config=CONFIG, init_kwargs={"trackio": init})
    assert isinstance(accelerator.get_tracker("trackio", unwrap=True), Run)
    accelerator.log({"loss": 0.5, "acc": 0.75}, step=1)
    accelerator.log({"loss": 0.25, "note": "hello"}, step=2)
    accelerator.end_training()


RUNS: dict[str, Callable[[str, Path], None]] = {
    "aim": run_aim,
    "clearml": run_clearml,
    "dvclive": run_dvclive,
    "swanlab": run_swanlab,
    "trackio": run_trackio,
}


if __name__ == "__main__":
    from tests.helpers import reset_accelerator_states

    root = Path(sys.argv[1])
    os.chdir(root)  # DVCLive and Aim look for repositories from the working directory
    for tracker in sys.argv[2:]:
        (root / tracker).mkdir(exist_ok=True)
        for framework in ("hf", "ours"):
            RUNS[tracker](framework, root / tracker)
            reset_accelerator_states()
