"""The README's main job: examples/train.py starts 2 CPU processes through Lightning's own launcher."""

from __future__ import annotations

import re

from tests.helpers import REPO, run_python


def test_example_trains_with_acc_ddp_on_two_processes() -> None:
    proc = run_python([str(REPO / "examples" / "train.py"), "--max_epochs", "2"], timeout=300)
    match = re.search(r"strategy=acc_ddp world_size=2 final val_acc=([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    # Four classes: chance is 0.25; the synthetic task is learnable to well above that in two epochs.
    assert float(match.group(1)) > 0.7
