"""examples/accelerate_complete_example.py: same output as under HF accelerate, and an exact resume after an epoch."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO, run_python

EXAMPLE = REPO / "examples" / "accelerate_complete_example.py"


def epochs(stdout: str) -> list[str]:
    return re.findall(r"^epoch \d+: accuracy=[0-9.]+ over \d+ samples$", stdout, flags=re.MULTILINE)


def test_example_matches_hf_accelerate_and_resumes_exactly(tmp_path: Path) -> None:
    ours = run_python([str(EXAMPLE), "--cpu", "--output_dir", str(tmp_path / "ours"), "--checkpointing_steps", "epoch"])
    lines = epochs(ours.stdout)
    assert len(lines) == 3, ours.stdout[-2000:]
    assert float(lines[-1].split("=")[1].split()[0]) > 0.6  # 4 classes: chance is 0.25
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["epoch_0", "epoch_1", "epoch_2"]

    hf_script = tmp_path / "hf_example.py"
    hf_script.write_text(EXAMPLE.read_text().replace("lightning_accel", "accelerate"))
    hf = run_python([str(hf_script), "--cpu", "--output_dir", str(tmp_path / "hf"), "--checkpointing_steps", "epoch"])
    assert epochs(hf.stdout) == lines

    resume = ["--resume_from_checkpoint", str(tmp_path / "ours" / "epoch_0")]
    resumed = run_python([str(EXAMPLE), "--cpu", "--output_dir", str(tmp_path / "ours"), *resume])
    assert epochs(resumed.stdout) == lines[1:]
