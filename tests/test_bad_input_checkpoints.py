"""Checkpoints from elsewhere (a killed save, another run, another world size): refused or restored, said (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import REPO, run_python

_STRATEGIES = ("acc_no", "acc_multi_cpu", "acc_fsdp", "acc_parallel", "acc_deepspeed")


def test_trainer_resume_from_a_corrupted_ckpt_names_the_file_under_every_strategy(tmp_path: Path) -> None:
    """Lightning (and torch) raise ``PytorchStreamReader failed reading zip archive`` without the file's path."""
    run_python(
        [str(REPO / "tests" / "scripts" / "bad_input_corrupt_ckpt.py"), str(tmp_path), *_STRATEGIES], timeout=600
    )
    results = json.loads((tmp_path / "results.json").read_text())
    path = str(tmp_path / "last.ckpt")
    for strategy in ("acc_no", "acc_multi_cpu", "acc_fsdp", "acc_parallel"):
        raised = results[strategy]
        assert raised["type"] == "ValueError", (strategy, raised)
        assert raised["message"].startswith(f"Could not read checkpoint file {path}: PytorchStreamReader"), raised
        assert "truncated or corrupt" in raised["message"]
    # DeepSpeed resumes from a checkpoint directory; Lightning already refuses a file, naming it.
    assert results["acc_deepspeed"] == {
        "type": "FileNotFoundError",
        "message": f"The provided path is not a valid DeepSpeed checkpoint: {path}",
    }
