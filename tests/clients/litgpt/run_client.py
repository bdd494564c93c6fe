"""The litgpt client: litgpt's ``pretrain.main``, unmodified, under Lightning's ``ddp`` and under ``acc_*`` strategies.

litgpt does not fit the main environment (the clients stage runs it under ``numpy<2``), so this builds ``.venv-litgpt``
in the repository root (``torch==2.13.0``, this package editable, litgpt, torchdata for a resumable loader, pytest) and
reuses it while it still matches. Every training run is ``pretrain_driver.py``: a 2-layer GPT on seeded synthetic
tokens, 2 CPU processes, 8 optimizer steps of 2 accumulated micro-batches, checkpoints at steps 4 and 8.

Scenarios (reference: Lightning's ``ddp`` on the same program, in the same invocation):

- ``numpy-1.26-import``: ``tests/unit/test_numpy_versions.py`` in the litgpt environment (``import lightning_accel``,
  checkpoint RNG states) passes under numpy 1.26.
- ``pretrain-acc_ddp``: per-step losses and final weights equal ddp's bit for bit.
- ``pretrain-acc_fsdp``: ``acc_fsdp`` set up as litgpt sets up Lightning's FSDP (full checkpoints, a unit per
  ``Block``): losses and weights within ``atol=1e-5`` of ddp's (FSDP reduce-scatters where DDP all-reduces).
- ``resume-<strategy>``: litgpt's ``resume=True`` from its own ``step-00000004`` checkpoint ends with the
  uninterrupted run's final weights (bit for bit) and logs its last losses; the stateful train loader must resume
  mid-epoch for that. ``resume-ddp`` is the reference itself, for the record.
- ``load_checkpoint-acc_fsdp``: litgpt's ``utils.load_checkpoint`` takes its ``FSDPStrategy`` branch
  (``fabric.load_raw``) and the sharded model then holds the file's weights (ddp's final ones) exactly.

``TORCH_COMPILE_DISABLE=1`` for every run, reference included: ``pretrain.main`` compiles the model, and CPU inductor
compiles in 2 processes for each of 7 launches would not fit the budget; the comparison is of the strategies.

Usage: ``python tests/clients/litgpt/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers import clean_env, free_port  # noqa: E402

VENV = ROOT / ".venv-litgpt"
LITGPT = "litgpt==0.5.13"
PACKAGES = ["torch==2.13.0", "-e", str(ROOT), LITGPT, "numpy<2", "torchdata>=0.8", "pytest>=8"]
DRIVER = HERE / "pretrain_driver.py"
LAUNCH_TIMEOUT = 300
FSDP_ATOL = 1e-5
RESUME_FROM = "step-00000004"


def venv_python() -> Path:
    return VENV / "bin" / "python"


def venv_matches() -> str:
    """An empty string when ``.venv-litgpt`` holds what this client needs, else what is wrong with it."""
    if not venv_python().exists():
        return "absent"
    probe = (
        "import json, numpy, torch, importlib.metadata as m, lightning_accel, torchdata, pytest;"
        "print(json.dumps({'numpy': numpy.__version__, 'torch': torch.__version__, 'litgpt': m.version('litgpt'),"
        "'package': lightning_accel.__file__}))"
    )
    proc = subprocess.run([str(venv_python()), "-c", probe], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "probe failed"
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    if not found["numpy"].startswith("1."):
        problems.append(f"numpy {found['numpy']}")
    if not found["torch"].startswith("2.13.0"):
        problems.append(f"torch {found['torch']}")
    if found["litgpt"] != LITGPT.split("==")[1]:
        problems.append(f"litgpt {found['litgpt']}")
    if not Path(found["package"]).resolve().is_relative_to(ROOT):
        problems.append(f"lightning_accel from {found['package']}")
    return ", ".join(problems)


def ensure_venv() -> dict[str, Any]:
    """Build ``.venv-litgpt`` unless it already matches; returns how long that took and whether it was built."""
    start = time.perf_counter()
    problem = venv_matches()
    if problem:
        print(f"litgpt client: building {VENV.name} ({problem})", flush=True)
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *PACKAGES], check=True, timeout=1200)
        if still := venv_matches():
            raise RuntimeError(f"{VENV} does not match after installing {PACKAGES}: {still}")
    return {"built": bool(problem), "why": problem, "seconds": round(time.perf_counter() - start, 1)}


class Launches:
    """The driver's 2-process runs, each started at most once and kept under ``work``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.done: dict[str, Path] = {}

    def run(self, key: str, *args: str, prepare: Callable[[Path], None] | None = None) -> Path:
        if key in self.done:
            return self.done[key]
        out = self.work / key
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if prepare is not None:
            prepare(out)
        cmd = [str(venv_python()), str(DRIVER), "--out", str(out), *args]
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCH_COMPILE_DISABLE="1")
        env.pop("PYTHONPATH", None)  # the litgpt environment has this package installed (editable)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=ROOT)
        except subprocess.TimeoutExpired as err:
            (out / "driver.log").write_text(f"{err.stdout or ''}\n{err.stderr or ''}")
            raise ScenarioError(f"{key}: timed out after {LAUNCH_TIMEOUT}s") from err
        (out / "driver.log").write_text(proc.stdout + "\n" + proc.stderr)
        print(f"litgpt client: {key} took {time.perf_counter() - start:.0f}s (exit {proc.returncode})", flush=True)
        if proc.returncode != 0:
            raise ScenarioError(f"{key}: exit {proc.returncode}: {last_line(proc.stderr or proc.stdout)}")
        self.done[key] = out
        return out

    def train(self, strategy: str) -> Path:
        return self.run(strategy, "--strategy", strategy)

    def resume(self, strategy: str) -> Path:
        def copy_checkpoint(out: Path) -> None:
            shutil.copytree(self.train(strategy) / RESUME_FROM, out / RESUME_FROM)

        return self.run(f"{strategy}-resumed", "--strategy", strategy, "--resume", prepare=copy_checkpoint)


class ScenarioError(Exception):
    """A scenario that could not be compared (a run failed, an output is missing)."""


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    causes = [line for line in errors if "Connection closed by peer" not in line]  # the other rank's echo of a crash
    return (causes or errors or lines or [""])[-1].strip()[:300]


def losses(out: Path) -> list[tuple[int, float]]:
    """Rank 0's logged training losses, as (iteration, loss)."""
    path = out / "logs" / "csv" / "version_0" / "metrics.csv"
    with path.open() as file:
        return [(int(float(row["iter"])), float(row["loss"])) for row in csv.DictReader(file) if row.get("loss")]


def final_state(out: Path, name: str = "final/lit_model.pth") -> dict[str, Any]:
    import torch

    path = out / name
    if not path.is_file():
        raise ScenarioError(f"no checkpoint file {path.relative_to(out.parent)}")
    return torch.load(path, map_location="cpu", weights_only=False)


def max_weight_diff(ours: dict[str, Any], reference: dict[str, Any]) -> float:
    if ours.keys() != reference.keys():
        raise ScenarioError(f"parameter names differ: {sorted(set(ours) ^ set(reference))[:4]}")
    return max(float((ours[k].float() - reference[k].float()).abs().max()) for k in reference)


def compare_training(ours: Path, reference: Path, atol: float) -> tuple[bool, str]:
    ours_losses, reference_losses = losses(ours), losses(reference)
    if [i for i, _ in ours_losses] != [i for i, _ in reference_losses] or not reference_losses:
        return False, f"logged iterations differ: {ours_losses} vs {reference_losses}"
    loss_diff = max(abs(a - b) for (_, a), (_, b) in zip(ours_losses, reference_losses, strict=True))
    a, b = final_state(ours), final_state(reference)
    weight_diff = max_weight_diff(a["model"], b["model"])
    counters = (a["iter_num"], a["step_count"]) == (b["iter_num"], b["step_count"])
    ok = loss_diff <= atol and weight_diff <= atol and counters
    return ok, (
        f"{len(ours_losses)} logged losses, max abs diff {loss_diff:.3g}; final weights max abs diff {weight_diff:.3g};"
        f" iter/step {a['iter_num']}/{a['step_count']} vs {b['iter_num']}/{b['step_count']}"
    )


def scenario_numpy() -> tuple[bool, str]:
    cmd = [str(venv_python()), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_numpy_versions.py"]
    env = clean_env()
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    version = subprocess.run(
        [str(venv_python()), "-c", "import numpy; print(numpy.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return proc.returncode == 0 and version.startswith("1."), f"numpy {version}: {last_line(proc.stdout)}"


def scenario_training(launches: Launches, strategy: str, atol: float) -> tuple[bool, str]:
    return compare_training(launches.train(strategy), launches.train("ddp"), atol)


def scenario_resume(launches: Launches, strategy: str, atol: float) -> tuple[bool, str]:
    """The resumed run against its own uninterrupted run (bit for bit) and against ddp's resumed run."""
    uninterrupted, resumed = launches.train(strategy), launches.resume(strategy)
    logged = dict(losses(uninterrupted))
    resumed_losses = losses(resumed)
    if not resumed_losses or resumed_losses[0][0] <= int(RESUME_FROM.split("-")[1]) * 2:
        return False, f"the resumed run logged {resumed_losses}: it did not start after {RESUME_FROM}"
    loss_diff = max(abs(loss - logged[i]) for i, loss in resumed_losses)
    own_diff = max_weight_diff(final_state(resumed)["model"], final_state(uninterrupted)["model"])
    ddp_diff = max_weight_diff(final_state(resumed)["model"], final_state(launches.resume("ddp"))["model"])
    ok = loss_diff == 0 and own_diff == 0 and ddp_diff <= atol
    return ok, (
        f"resumed after iter {int(RESUME_FROM.split('-')[1]) * 2}: {len(resumed_losses)} losses max abs diff"
        f" {loss_diff:.3g}, final weights"
        f" vs uninterrupted {own_diff:.3g}, vs ddp's resumed run {ddp_diff:.3g}"
    )


def scenario_load_checkpoint(launches: Launches, strategy: str) -> tuple[bool, str]:
    """litgpt's ``load_checkpoint`` of a plain state-dict file (ddp's final weights) into a set-up model.

    Under ddp litgpt takes its other branch, ``model.load_state_dict(torch.load(path))``: plain PyTorch, exact by
    construction, so only the sharded strategy is launched.
    """
    import torch

    plain = launches.work / "plain_lit_model.pth"
    if not plain.exists():
        torch.save(final_state(launches.train("ddp"))["model"], plain)
    expected = torch.load(plain, weights_only=True)
    out = launches.run(f"load-{strategy}", "--strategy", strategy, "--load", str(plain))
    diff = max_weight_diff(final_state(out, "loaded.pth")["model"], expected)
    return diff == 0, f"litgpt's FSDPStrategy branch (fabric.load_raw): weights vs the file, max abs diff {diff:.3g}"


def scenarios(launches: Launches) -> list[tuple[str, str, str, Callable[[], tuple[bool, str]]]]:
    """(id, reference, comparison, check) for every scenario."""
    return [
        ("numpy-1.26-import", "numpy 1.26 (litgpt environment)", "passes", scenario_numpy),
        ("pretrain-acc_ddp", "lightning ddp", "bit-identical", lambda: scenario_training(launches, "acc_ddp", 0.0)),
        (
            "pretrain-acc_fsdp",
            "lightning ddp",
            f"atol={FSDP_ATOL}",
            lambda: scenario_training(launches, "acc_fsdp", FSDP_ATOL),
        ),
        ("resume-ddp", "lightning ddp uninterrupted", "bit-identical", lambda: scenario_resume(launches, "ddp", 0.0)),
        (
            "resume-acc_ddp",
            "own uninterrupted run; lightning ddp resumed",
            "bit-identical",
            lambda: scenario_resume(launches, "acc_ddp", 0.0),
        ),
        (
            "resume-acc_fsdp",
            "own uninterrupted run; lightning ddp resumed",
            f"bit-identical; atol={FSDP_ATOL} vs ddp",
            lambda: scenario_resume(launches, "acc_fsdp", FSDP_ATOL),
        ),
        (
            "load_checkpoint-acc_fsdp",
            "the state-dict file",
            "bit-identical",
            lambda: scenario_load_checkpoint(launches, "acc_fsdp"),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--only", default="*")
    args = parser.parse_args()
    start = time.perf_counter()
    venv = ensure_venv()
    work = args.work or Path(tempfile.mkdtemp(prefix="litgpt-client-"))
    launches = Launches(work)
    results = []
    for name, reference, comparison, check in scenarios(launches):
        scenario_id = f"litgpt::{name}"
        if not fnmatch.fnmatch(scenario_id, args.only) and not fnmatch.fnmatch(name, args.only):
            continue
        try:
            ok, detail = check()
        except ScenarioError as err:
            ok, detail = False, str(err)
        except Exception as err:  # a comparison that broke is a failed scenario, not a broken harness
            ok, detail = False, f"{type(err).__name__}: {err}"[:300]
        results.append(
            {"id": scenario_id, "reference": reference, "comparison": comparison, "ok": ok, "detail": detail}
        )
        print(f"litgpt client: {scenario_id}: {'ok' if ok else 'NOT OK'}: {detail}", flush=True)
    report = {
        "client": "litgpt",
        "seconds": time.perf_counter() - start,
        "venv": venv,
        "work": str(work),
        "scenarios": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
