"""The transformers.Trainer client: the same Trainer script under HF accelerate and under lightning_accel.

``trainer_script.py`` (a tiny random BERT built from a config, seeded synthetic data, no downloads) runs once per
side for each process below; "ours" is the same unmodified program with ``accelerate`` resolved to lightning_accel
(``LIGHTNING_ACCEL_ALIAS=1``, see ``site/sitecustomize.py``). Each scenario compares what both sides wrote: final
weights, per-step losses, evaluation metrics and predictions, saved model files and checkpoint file names.

Usage: ``python tests/clients/transformers_trainer/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``
(see tests/clients/run.py and the stage's contract).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SCRIPT = HERE / "trainer_script.py"
CLIENT = "transformers_trainer"
SIDES = ("hf", "ours")
TIMEOUT = 300


@dataclass(frozen=True)
class Run:
    """One launch of the Trainer script per side: ``name`` is its output folder, ``after`` a run it resumes from."""

    name: str
    args: tuple[str, ...]
    processes: int = 1
    sides: tuple[str, ...] = SIDES
    after: str | None = None


@dataclass
class Scenario:
    """What one scenario compares, from which runs."""

    id: str
    runs: tuple[str, ...]
    check: Callable[[dict[str, dict[str, Any]], Path], tuple[bool, str]]
    comparison: str = "bit-identical"
    reference: str = field(default_factory=lambda: f"hf accelerate {metadata.version('accelerate')}")


ZERO2, ZERO3 = str(HERE / "zero2.json"), str(HERE / "zero3.json")
ACCUM_CLIP = ("--accum", "2", "--max-grad-norm", "0.5")
RUNS = [
    Run("single", ("--eval", "--save-steps", "4")),
    Run("accum_clip", ACCUM_CLIP),
    Run("peft", ("--peft",)),
    Run("resume", ("--resume", "single/trainer/checkpoint-4"), after="single"),
    Run("ddp2", (*ACCUM_CLIP, "--eval"), processes=2),
    Run("fsdp2", (*ACCUM_CLIP, "--eval", "--fsdp"), processes=2, sides=("ours",)),
    Run("zero2", ("--deepspeed", ZERO2, *ACCUM_CLIP, "--save-steps", "2", "--save-model"), processes=2),
    Run(
        "zero2_resume", ("--deepspeed", ZERO2, *ACCUM_CLIP, "--resume", "zero2/trainer/checkpoint-2"), 2, after="zero2"
    ),
    Run("zero3", ("--deepspeed", ZERO3, *ACCUM_CLIP, "--save-steps", "2", "--save-model"), processes=2),
    Run(
        "zero3_resume", ("--deepspeed", ZERO3, *ACCUM_CLIP, "--resume", "zero3/trainer/checkpoint-2"), 2, after="zero3"
    ),
]


def environment(side: str) -> dict[str, str]:
    """Offline, no inherited Accelerate settings; lightning_accel of this checkout; the alias on our side only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "LIGHTNING_ACCEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "site"), str(ROOT)])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if side == "ours":
        env["LIGHTNING_ACCEL_ALIAS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(run: Run, side: str, work: Path) -> tuple[bool, str, float]:
    """Run ``run`` for ``side`` in ``work/side``; (succeeded, last line of the failure, seconds)."""
    folder = work / side
    folder.mkdir(parents=True, exist_ok=True)
    args = [a if not a.endswith(("checkpoint-2", "checkpoint-4")) else str(folder / a) for a in run.args]
    command = [sys.executable]
    if run.processes > 1:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={run.processes}", "--master_addr=127.0.0.1"]
        command += [f"--master_port={_free_port()}"]
    command += [str(SCRIPT), "--out", str(folder / run.name), *args]
    start = time.monotonic()
    log = folder / f"{run.name}.log"
    try:
        with log.open("w") as out:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=environment(side),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=TIMEOUT,
                check=False,
            )
        ok, detail = done.returncode == 0, "" if done.returncode == 0 else _last_error(log)
    except subprocess.TimeoutExpired:
        ok, detail = False, f"timed out after {TIMEOUT} s"
    return ok, detail, time.monotonic() - start


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def _load(work: Path, side: str, run: str) -> dict[str, Any]:
    return torch.load(work / side / run / "result.pt", weights_only=False)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different weight names: {sorted(set(a) ^ set(b))[:4]}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def same_training(run: str, reference: tuple[str, str] | None = None, atol: float = 0.0) -> Callable[..., Any]:
    """Ours' ``run`` against HF's (or against ``reference`` = (side, run)): weights and losses within ``atol``."""

    def check(_: dict[str, dict[str, Any]], work: Path) -> tuple[bool, str]:
        ours = _load(work, "ours", run)
        theirs = _load(work, *(reference or ("hf", run)))
        diff = _max_diff(ours["weights"], theirs["weights"])
        loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        steps = (ours["global_step"], theirs["global_step"])
        ok = diff <= atol and loss_diff <= max(atol, 0.0) and steps[0] == steps[1]
        return ok, f"weights max abs diff {diff:.3g}, losses {loss_diff:.3g}, steps {steps[0]}/{steps[1]}"

    return check


def same_evaluation(run: str) -> Callable[..., Any]:
    """Evaluation loss and the predictions (padded last batch gathered and trimmed) against HF's."""

    def check(_: dict[str, dict[str, Any]], work: Path) -> tuple[bool, str]:
        ours, hf = _load(work, "ours", run), _load(work, "hf", run)
        loss = (ours["metrics"]["eval_loss"], hf["metrics"]["eval_loss"])
        shapes = (tuple(ours["predictions"].shape), tuple(hf["predictions"].shape))
        same = shapes[0] == shapes[1] and torch.equal(ours["predictions"], hf["predictions"])
        same = same and torch.equal(ours["label_ids"], hf["label_ids"]) and loss[0] == loss[1]
        return same, f"eval_loss {loss[0]:.6g}/{loss[1]:.6g}, predictions {shapes[0]}/{shapes[1]}"

    return check


def same_files(run: str, checkpoint: str) -> Callable[..., Any]:
    """Training as HF's, the saved model file equal, and the checkpoint folder with HF's file names."""
    training = same_training(run)

    def check(results: dict[str, dict[str, Any]], work: Path) -> tuple[bool, str]:
        from safetensors.torch import load_file

        ok, detail = training(results, work)
        saved = [load_file(work / side / run / "saved" / "model.safetensors") for side in SIDES]
        saved_diff = _max_diff(saved[1], saved[0])
        names = [_names(work / side / run / "trainer" / checkpoint) for side in SIDES]
        missing = sorted(names[0] ^ names[1])
        ok = ok and saved_diff == 0 and not missing
        return ok, f"{detail}; saved model diff {saved_diff:.3g}; checkpoint files differing: {missing[:3] or 'none'}"

    return check


def _names(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


SCENARIOS = [
    Scenario(f"{CLIENT}::single_process", ("single",), same_training("single")),
    Scenario(f"{CLIENT}::accumulation_max_grad_norm", ("accum_clip",), same_training("accum_clip")),
    Scenario(f"{CLIENT}::eval_predict_padded_last_batch", ("single",), same_evaluation("single")),
    Scenario(f"{CLIENT}::resume_in_fresh_process", ("single", "resume"), same_training("resume")),
    Scenario(f"{CLIENT}::two_processes", ("ddp2",), same_training("ddp2")),
    Scenario(f"{CLIENT}::two_processes_eval_predict", ("ddp2",), same_evaluation("ddp2")),
    Scenario(f"{CLIENT}::peft_lora", ("peft",), same_training("peft")),
    Scenario(f"{CLIENT}::deepspeed_zero2_save", ("zero2",), same_files("zero2", "checkpoint-2")),
    Scenario(f"{CLIENT}::deepspeed_zero2_resume", ("zero2", "zero2_resume"), same_training("zero2_resume")),
    Scenario(f"{CLIENT}::deepspeed_zero3_save", ("zero3",), same_files("zero3", "checkpoint-2")),
    Scenario(f"{CLIENT}::deepspeed_zero3_resume", ("zero3", "zero3_resume"), same_training("zero3_resume")),
    Scenario(
        f"{CLIENT}::fsdp_full_shard_equals_own_ddp",
        ("ddp2", "fsdp2"),
        same_training("fsdp2", reference=("ours", "ddp2"), atol=1e-6),
        comparison="atol=1e-6",
        reference="lightning_accel's own DDP run (HF accelerate falls back to DDP on CPU)",
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--only", default="*")
    args = parser.parse_args()
    start = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="clients-transformers-"))
    chosen = [
        s for s in SCENARIOS if fnmatch.fnmatch(s.id, args.only) or fnmatch.fnmatch(s.id.split("::")[1], args.only)
    ]
    needed = {name for scenario in chosen for name in scenario.runs}
    outcomes = execute([run for run in RUNS if run.name in needed], work)
    scenarios = [evaluate(scenario, outcomes, work) for scenario in chosen]
    result = {"client": CLIENT, "seconds": round(time.monotonic() - start, 1), "scenarios": scenarios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for s in scenarios:
        print(f"{'ok ' if s['ok'] else 'NOT'} {s['id']}: {s['detail']}")
    print(f"[{CLIENT}] {sum(s['ok'] for s in scenarios)}/{len(scenarios)} ok in {result['seconds']} s; work in {work}")
    return 0


def execute(runs: list[Run], work: Path) -> dict[str, dict[str, Any]]:
    """Launch every run on each of its sides: one-process runs two at a time (the machine has 2 cores), the others
    one after the other. A run that resumes another waits for it and is skipped on a side where that one failed.
    """
    outcomes: dict[str, dict[str, Any]] = {}
    batch: list[tuple[Run, str]] = []

    def record(run: Run, side: str, outcome: tuple[bool, str, float]) -> None:
        outcomes.setdefault(run.name, {})[side] = outcome
        ok, detail, seconds = outcome
        print(f"[{CLIENT}] {run.name:<14} {side:<4} {'ok' if ok else 'FAILED'} {seconds:6.1f} s {detail}", flush=True)

    def flush() -> None:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [(run, side, pool.submit(launch, run, side, work)) for run, side in batch]
        for run, side, future in futures:
            record(run, side, future.result())
        batch.clear()

    for run in runs:
        if run.processes > 1 or run.after is not None:
            flush()
        for side in run.sides:
            if run.after is not None and not outcomes.get(run.after, {}).get(side, (False,))[0]:
                record(run, side, (False, f"not run: {run.after} failed on {side}", 0.0))
            elif run.processes == 1:
                batch.append((run, side))
            else:
                record(run, side, launch(run, side, work))
    flush()
    return outcomes


def evaluate(scenario: Scenario, outcomes: dict[str, dict[str, Any]], work: Path) -> dict[str, Any]:
    """One scenario's entry of RESULT.json: a failed run on either side is the detail, else the comparison's."""
    failed = [f"{side} {name}: {o[1]}" for name in scenario.runs for side, o in outcomes[name].items() if not o[0]]
    if failed:
        ok, detail = False, failed[0]
    else:
        try:
            ok, detail = scenario.check(outcomes, work)
        except Exception as error:  # a comparison that cannot be made is a not-ok scenario, not a broken harness
            ok, detail = False, f"{type(error).__name__}: {error}"
    return {
        "id": scenario.id,
        "reference": scenario.reference,
        "comparison": scenario.comparison,
        "ok": ok,
        "detail": detail,
    }


if __name__ == "__main__":
    sys.exit(main())
