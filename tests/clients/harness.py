"""What every ``run_client.py`` of a program launched once per side shares: runs, scenarios, launching, comparing.

A client declares its :class:`Run` list (one launch of its script per side: HF accelerate's ``"hf"`` and
lightning_accel's ``"ours"``, at some number of processes, maybe resuming an earlier run) and its :class:`Scenario`
list (which runs each compares, and how), then calls :func:`main`. Both sides run the same unmodified script; "ours"
has ``accelerate`` resolved to lightning_accel (``LIGHTNING_ACCEL_ALIAS=1`` and the peer stage's alias, loaded by
``transformers_trainer/site/sitecustomize.py``, which every such client puts on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "transformers_trainer" / "site"  # the alias (and DeepSpeed's shm guard)
SIDES = ("hf", "ours")

Outcomes = dict[str, dict[str, tuple[bool, str, float]]]  # run -> side -> (succeeded, failure, seconds)
Check = Callable[[Outcomes, Path], tuple[bool, str]]


@dataclass(frozen=True)
class Run:
    """One launch of the client's script per side: ``name`` is its output folder, ``after`` a run it resumes from.

    ``args`` may contain ``{out}`` (this run's folder), ``{side}`` (this side's work folder) and ``{work}`` (the
    client's work folder, shared by both sides), filled in at launch.
    """

    name: str
    args: tuple[str, ...]
    processes: int = 1
    sides: tuple[str, ...] = SIDES
    after: str | None = None
    copy: tuple[str, ...] = ()  # paths inside ``after``'s folder copied into this run's folder before it starts


@dataclass
class Scenario:
    """What one scenario compares, from which runs."""

    id: str
    runs: tuple[str, ...]
    check: Check
    comparison: str = "bit-identical"
    reference: str = field(default_factory=lambda: f"hf accelerate {metadata.version('accelerate')}")


@dataclass(frozen=True)
class Client:
    """A client: its name, script, runs and scenarios, and each run's time limit."""

    name: str
    script: Path | Callable[[Path], Path]  # or what writes the script (and its inputs) into the work folder
    runs: Sequence[Run]
    scenarios: Sequence[Scenario]
    timeout: int = 300
    extra_path: tuple[Path, ...] = ()  # more PYTHONPATH entries, on both sides
    site: Path = SITE  # the folder whose sitecustomize.py starts every process (it must load the alias)
    variables: tuple[tuple[str, str], ...] = ()  # environment variables of every run, on both sides
    retry_reference: bool = False  # every reference run is expected to succeed: a failed one is run once more


def environment(side: str, extra_path: Sequence[Path] = (), site: Path = SITE) -> dict[str, str]:
    """Offline, no inherited Accelerate settings; lightning_accel of this checkout; the alias on our side only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "LIGHTNING_ACCEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *map(str, extra_path), str(ROOT)])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8", HF_DATASETS_OFFLINE="1")
    if side == "ours":
        env["LIGHTNING_ACCEL_ALIAS"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(client: Client, run: Run, side: str, work: Path) -> tuple[bool, str, float]:
    """Run ``run`` for ``side`` in ``work/side``; (succeeded, the failure, seconds).

    For a client with ``retry_reference`` (one whose reference runs all succeed), a reference-side run that fails is
    run once more: the reference is not what is tested, and a rare failure of its own (HF's DeepSpeed resume failed
    once in CI and never here) would otherwise hide every comparison. The retry is printed with the first failure,
    and a second failure is reported as it is. Our side is never retried.
    """
    outcome = _launch_once(client, run, side, work)
    if outcome[0] or side == "ours" or not client.retry_reference:
        return outcome
    print(f"[{client.name}] {run.name} {side}: failed ({outcome[1]}); running it once more", flush=True)
    return _launch_once(client, run, side, work)


def _launch_once(client: Client, run: Run, side: str, work: Path) -> tuple[bool, str, float]:
    folder = work / side
    folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder / run.name, ignore_errors=True)  # a work folder used before: this run starts from nothing
    for path in run.copy:
        source, destination = folder / str(run.after) / path, folder / run.name / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination)
        else:
            shutil.copy2(source, destination)
    args = [a.format(out=folder / run.name, side=folder, work=work) for a in run.args]
    command = [sys.executable]
    if run.processes > 1:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={run.processes}", "--master_addr=127.0.0.1"]
        command += [f"--master_port={free_port()}"]
    command += [str(client.script), *args]  # main() has resolved a script written into the work folder
    start = time.monotonic()
    log = folder / f"{run.name}.log"
    try:
        with log.open("w") as out:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env={**environment(side, client.extra_path, client.site), **dict(client.variables)},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=client.timeout,
                check=False,
            )
        ok, detail = done.returncode == 0, "" if done.returncode == 0 else last_error(log)
    except subprocess.TimeoutExpired:
        ok, detail = False, f"timed out after {client.timeout} s"
    return ok, detail, time.monotonic() - start


_LAUNCHER_LINES = ("error_file:", "traceback :", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")


def last_error(log: Path) -> str:
    """The line of ``log`` that says what failed: a process's exception rather than torchrun's summary of it.

    The log's last lines are printed too, so that the failure can be read where only the stage's output is kept.
    """
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    print(f"--- the last lines of {log}:", *lines[-25:], "---", sep="\n", flush=True)
    errors = [
        line
        for line in lines
        if ("Error" in line or "error" in line) and not any(mark in line for mark in _LAUNCHER_LINES)
    ]
    return (errors or lines or ["(no output)"])[-1][:300]


def load_result(work: Path, side: str, run: str) -> dict[str, Any]:
    """What the script wrote on process 0: ``<work>/<side>/<run>/result.pt``."""
    return torch.load(work / side / run / "result.pt", weights_only=False)


def checkpoint_files(folder: Path) -> list[str]:
    """The files under a checkpoint ``folder`` (relative paths) that both sides write.

    ``save_state`` of ours adds ``checkpoint_manifest.json`` (sizes and checksums of the files, checked on load), which
    HF accelerate has no counterpart of; every other file must match.
    """
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != "checkpoint_manifest.json"
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different weight names: {sorted(set(a) ^ set(b))[:4]}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def same_training(run: str, reference: tuple[str, str] | None = None, atol: float = 0.0) -> Check:
    """Ours' ``run`` against HF's (or against ``reference`` = (side, run)): weights, losses and steps."""

    def check(_: Outcomes, work: Path) -> tuple[bool, str]:
        ours = load_result(work, "ours", run)
        theirs = load_result(work, *(reference or ("hf", run)))
        diff = max_diff(ours["weights"], theirs["weights"])
        loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        steps = (ours["global_step"], theirs["global_step"])
        ok = diff <= atol and loss_diff <= atol and steps[0] == steps[1]
        return ok, f"weights max abs diff {diff:.3g}, losses {loss_diff:.3g}, steps {steps[0]}/{steps[1]}"

    return check


def execute(client: Client, runs: list[Run], work: Path) -> Outcomes:
    """Launch every run on each of its sides: one-process runs two at a time (the machine has 2 cores), the others
    one after the other. A run that resumes another waits for it and is skipped on a side where that one failed.
    """
    outcomes: Outcomes = {}
    batch: list[tuple[Run, str]] = []

    def record(run: Run, side: str, outcome: tuple[bool, str, float]) -> None:
        outcomes.setdefault(run.name, {})[side] = outcome
        ok, detail, seconds = outcome
        status = "ok" if ok else "FAILED"
        print(f"[{client.name}] {run.name:<16} {side:<4} {status} {seconds:6.1f} s {detail}", flush=True)

    def flush() -> None:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [(run, side, pool.submit(launch, client, run, side, work)) for run, side in batch]
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
                record(run, side, launch(client, run, side, work))
    flush()
    return outcomes


def evaluate(scenario: Scenario, outcomes: Outcomes, work: Path) -> dict[str, Any]:
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


def main(client: Client, description: str) -> int:
    """``run_client.py --out RESULT.json [--work DIR] [--only GLOB]``: run the chosen scenarios, write the result."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--only", default="*")
    args = parser.parse_args()
    start = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix=f"clients-{client.name}-"))
    chosen = [
        s
        for s in client.scenarios
        if fnmatch.fnmatch(s.id, args.only) or fnmatch.fnmatch(s.id.split("::")[1], args.only)
    ]
    needed = {name for scenario in chosen for name in scenario.runs}
    if callable(client.script):
        client = replace(client, script=client.script(work))
    outcomes = execute(client, [run for run in client.runs if run.name in needed], work)
    scenarios = [evaluate(scenario, outcomes, work) for scenario in chosen]
    result = {"client": client.name, "seconds": round(time.monotonic() - start, 1), "scenarios": scenarios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for s in scenarios:
        print(f"{'ok ' if s['ok'] else 'NOT'} {s['id']}: {s['detail']}")
    ok_count = sum(s["ok"] for s in scenarios)
    print(f"[{client.name}] {ok_count}/{len(scenarios)} ok in {result['seconds']} s; work in {work}")
    return 0
