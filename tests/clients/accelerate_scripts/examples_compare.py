"""The example-style scenarios: ``examples/bert_example.py`` under HF accelerate and under lightning_accel.

Two launches per side (2 processes each): one runs the ``nlp``, ``accumulate``, ``checkpoint`` and ``no_sync`` modes,
a second resumes from the ``checkpoint`` run's mid-epoch ``step_6`` folder. The final weights are compared bit for
bit between the sides; the resumed run is also compared with the uninterrupted run of the same side.
"""

from __future__ import annotations

import fnmatch
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.clients.harness import checkpoint_files  # noqa: E402  (the repository root is put on the path above)

EXAMPLE = HERE / "examples" / "bert_example.py"
FIRST = ["nlp", "accumulate", "checkpoint", "no_sync"]
SIDES = ("hf", "ours")

Row = dict[str, object]


def _run_side(
    side: str,
    work: Path,
    environment: Callable[..., dict[str, str]],
    launch: Callable[..., str],
    torchrun: Callable[[list[str]], list[str]],
) -> dict[str, Any]:
    folder = work / side / "examples"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "checkpoints").mkdir(parents=True)
    notes = []
    for label, modes in (("first", FIRST), ("resume", ["resume"])):
        program = [str(EXAMPLE), "--out", str(folder), "--checkpoints", str(folder / "checkpoints"), "--modes", *modes]
        note = launch(torchrun(program), folder, environment(side, {}), 300, folder / f"log-{label}.txt")
        notes.append(note)
        print(f"  {side:4} examples/{label}: {note or 'done'}", flush=True)
    found: dict[str, Any] = {"notes": " ".join(filter(None, notes)), "folder": folder}
    for mode in [*FIRST, "resume"]:
        path = folder / f"{mode}.pt"
        errors = sorted(folder.glob(f"{mode}.rank*.error"))
        if errors:
            found[mode] = errors[0].read_text().strip().splitlines()[-1]
        elif path.exists():
            found[mode] = torch.load(path, weights_only=False)
        else:
            found[mode] = f"no result {found['notes']}".strip()
    return found


def _compare(a: Any, b: Any) -> tuple[bool, str]:
    """Bit-identical weights and equal accuracies; else the largest difference, or the error of either side."""
    if isinstance(a, str) or isinstance(b, str):
        return False, f"reference: {a if isinstance(a, str) else 'ran'}; compared: {b if isinstance(b, str) else 'ran'}"
    diffs = [float((a["weights"][k].double() - b["weights"][k].double()).abs().max()) for k in a["weights"]]
    same = (
        all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        and a["weights"].keys() == b["weights"].keys()
    )
    shared = min(len(a["accuracy"]), len(b["accuracy"]))  # a resumed run evaluates the epochs it trains only
    accuracy_a, accuracy_b = a["accuracy"][-shared:], b["accuracy"][-shared:]
    detail = f"max abs diff {max(diffs):.3g}; accuracy per epoch {accuracy_a} vs {accuracy_b}"
    return same and accuracy_a == accuracy_b, detail


def compare_examples(
    work: Path,
    only: str,
    environment: Callable[..., dict[str, str]],
    launch: Callable[..., str],
    torchrun: Callable[[list[str]], list[str]],
    scenario: Callable[..., Row],
) -> list[Row]:
    """The example scenarios (ids ``examples::<mode>``) that ``only`` selects."""
    if not any(fnmatch.fnmatch(f"accelerate_scripts::examples::{m}", only) for m in [*FIRST, "resume"]):
        return []
    runs = {side: _run_side(side, work, environment, launch, torchrun) for side in SIDES}
    rows: list[Row] = []
    for mode in FIRST:
        ok, detail = _compare(runs["hf"][mode], runs["ours"][mode])
        rows.append(scenario(f"examples::{mode}", "bit-identical", ok=ok, detail=detail))
    step = "checkpoints/step_3"
    hf_files, our_files = (checkpoint_files(runs[side]["folder"] / step) for side in SIDES)
    rows.append(
        scenario(
            "examples::checkpoint_files",
            "same file names",
            ok=hf_files == our_files and bool(hf_files),
            detail=f"hf {hf_files}; ours {our_files}"
            if hf_files != our_files
            else f"{len(hf_files)} files: {hf_files}",
        )
    )
    ok, detail = _compare(runs["hf"]["resume"], runs["ours"]["resume"])
    _, hf_detail = _compare(runs["hf"]["checkpoint"], runs["hf"]["resume"])
    rows.append(
        scenario(
            "examples::resume",
            "bit-identical",
            ok=ok,
            detail=f"{detail}; hf's resumed run vs hf's uninterrupted run: {hf_detail}",
        )
    )
    ok, detail = _compare(runs["ours"]["checkpoint"], runs["ours"]["resume"])
    rows.append(
        scenario(
            "examples::resume_equals_uninterrupted",
            "bit-identical",
            ok=ok,
            detail=detail,
            reference="the uninterrupted run (lightning_accel)",
        )
    )
    return rows


if __name__ == "__main__":
    sys.exit("run tests/clients/accelerate_scripts/run_client.py")
