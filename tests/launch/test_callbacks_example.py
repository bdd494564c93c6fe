"""examples/resume.py: the three callbacks on 2 CPU processes, a simulated preemption, resume, exact match."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO, run_python


def test_resume_example_ends_where_the_uninterrupted_run_ends(tmp_path: Path) -> None:
    proc = run_python(
        [str(REPO / "examples" / "resume.py"), "--project_dir", str(tmp_path), "--max_epochs", "2"], timeout=300
    )
    # 500 samples, 2 processes, batches of 16: 16 batches per epoch; windows of 3 give 6 steps per epoch.
    # Checkpoints every 4 steps (4, 8); preempted at step 11, so the run resumes from checkpoint_1 (step 8).
    assert re.search(r"preempted after optimizer step 11; newest complete checkpoint: .*checkpoint_1\n", proc.stdout)
    assert "checkpoints kept: ['checkpoint_1', 'checkpoint_2']" in proc.stdout
    assert "resumed run matches the uninterrupted run bit for bit: True" in proc.stdout
