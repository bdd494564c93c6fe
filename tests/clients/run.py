"""The clients stage: programs nobody on this team wrote, run under their reference and under lightning_accel.

Each client lives in a folder of its own beside this file (``transformers_trainer/``, ``accelerate_scripts/``,
``litgpt/``, ...) with a ``run_client.py`` that runs every scenario twice in one invocation (once under the reference:
HF accelerate, Lightning's built-in strategy; once under lightning_accel), compares the results and writes::

    {"client": "<name>", "seconds": 12.3,
     "scenarios": [{"id": "<name>::<scenario>", "reference": "...", "comparison": "bit-identical",
                    "ok": true, "detail": "max abs diff 0"}]}

This runner starts each client with a time limit, two at a time (``--jobs``: most clients keep the 2 cores busy only
part of the time; each line a runner prints is printed with its client's name before it), prints every scenario in
one table and fails when

- a scenario is not ok and the client's ``differences.yaml`` gives no reason for it (keys are scenario ids, or
  patterns where ``*`` matches anything), or
- a client has fewer ok scenarios than its ``floor.json`` records, or its runner broke (no result file).

Usage::

    python tests/clients/run.py                         # every client, checked against floors and differences
    python tests/clients/run.py --clients litgpt        # one client
    python tests/clients/run.py --update-floor          # then record today's ok counts in each floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from tests.peer.run import reason_for  # noqa: E402  (the peer stage's matching of ids and patterns)


@dataclass
class ClientResult:
    """What one client's runner reported, or why it reported nothing."""

    name: str
    scenarios: list[dict[str, object]] = field(default_factory=list)
    seconds: float = 0.0
    broken: str | None = None

    @property
    def ok_count(self) -> int:
        return sum(1 for scenario in self.scenarios if scenario.get("ok") is True)


def available_clients() -> list[str]:
    """Every folder beside this file that has a ``run_client.py``, in name order."""
    return sorted(path.parent.name for path in HERE.glob("*/run_client.py"))


def run_client(name: str, out: Path, timeout: int) -> ClientResult:
    """Start one client's runner with a time limit and read the result file it wrote.

    The runner writes its output to ``<out>/<name>.log``; each line is printed as it comes, with ``[name]`` before
    it (two clients run at a time).
    """
    result_file, log = out / f"{name}.json", out / f"{name}.log"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / name / "run_client.py"), "--out", str(result_file)]
    command += ["--work", str(out / name)]
    print(f"\n==== client {name}: {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    with log.open("w") as sink, log.open() as source:
        runner = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        while runner.poll() is None and time.monotonic() - start < timeout:
            _echo(name, source)
            time.sleep(1)
        timed_out = runner.poll() is None
        if timed_out:
            os.killpg(runner.pid, signal.SIGKILL)  # the runner and the processes it started
        returncode = runner.wait()
        _echo(name, source)
    seconds = time.monotonic() - start
    print(f"==== client {name}: ended in {seconds:.0f} s (exit {returncode})", flush=True)
    if timed_out:
        return ClientResult(name, seconds=seconds, broken=f"stopped after {timeout} s")
    if returncode != 0 or not result_file.exists():
        return ClientResult(name, seconds=seconds, broken=f"runner exited with {returncode}")
    data = json.loads(result_file.read_text())
    return ClientResult(name, scenarios=list(data["scenarios"]), seconds=seconds)


def _echo(name: str, source: TextIO) -> None:
    """Print what a runner wrote since the last call, each line after ``[name]`` (where it does not start so)."""
    tag = f"[{name}]"
    for line in source:
        shown = line if line.startswith(tag) else f"{tag} {line}"
        print(shown, end="" if shown.endswith("\n") else "\n", flush=True)


def table(results: list[ClientResult]) -> list[str]:
    """One Markdown row per scenario, and a count per client."""
    lines = ["| scenario | reference | comparison | ok | detail |", "|---|---|---|---|---|"]
    for result in results:
        for scenario in result.scenarios:
            ok = "yes" if scenario.get("ok") is True else "**no**"
            detail = str(scenario.get("detail", "")).replace("|", "/").replace("\n", " ")[:160]
            row = [scenario["id"], scenario.get("reference", ""), scenario.get("comparison", ""), ok, detail]
            lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
        status = result.broken or f"{result.ok_count} of {len(result.scenarios)} ok"
        lines.append(f"| **{result.name}** | | | | {status} in {result.seconds:.0f} s |")
    return lines


def problems_of(result: ClientResult) -> list[str]:
    """Everything about one client that fails the stage."""
    if result.broken:
        return [f"{result.name}: {result.broken}"]
    reasons = _read_yaml(HERE / result.name / "differences.yaml")
    floor = _read_json(HERE / result.name / "floor.json").get("ok", 0)
    problems = [
        f"{scenario['id']}: not ok ({scenario.get('detail', '')}) and differences.yaml gives no reason"
        for scenario in result.scenarios
        if scenario.get("ok") is not True and reason_for(str(scenario["id"]), reasons) is None
    ]
    if result.ok_count < floor:
        problems.append(f"{result.name}: {result.ok_count} scenarios ok, below the floor of {floor}")
    return problems


def stale_reasons(result: ClientResult) -> list[str]:
    """Ids that differences.yaml explains although the scenario is ok now.

    Patterns are never stale, nor is an entry whose reason starts with "Flaky" (a scenario that fails in some runs
    only is expected to be ok in others).
    """
    reasons = _read_yaml(HERE / result.name / "differences.yaml")
    ok = {str(scenario["id"]) for scenario in result.scenarios if scenario.get("ok") is True}
    return sorted(key for key, reason in reasons.items() if key in ok and not reason.startswith("Flaky"))


def _read_yaml(path: Path) -> dict[str, str]:
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def _read_json(path: Path) -> dict[str, int]:
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    """Run the stage; the exit status is 1 when a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", default=available_clients(), choices=available_clients())
    parser.add_argument("--out", type=Path, default=ROOT / ".clients-cache", help="result files and work folders")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds for one client")
    parser.add_argument("--update-floor", action="store_true", help="write today's ok counts to each floor.json")
    parser.add_argument("--jobs", type=int, default=2, help="clients run at the same time, in the order given")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda name: run_client(name, args.out, args.timeout), args.clients))
    lines = table(results)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    for result in results:
        for key in stale_reasons(result):
            print(f"note: {key} is ok now; remove it from {result.name}/differences.yaml")
        if args.update_floor and not result.broken:
            (HERE / result.name / "floor.json").write_text(json.dumps({"ok": result.ok_count}) + "\n")
    problems = [problem for result in results for problem in problems_of(result)]
    for problem in problems:
        print(f"FAIL {problem}")
    total = sum(len(result.scenarios) for result in results)
    print(f"clients: {sum(r.ok_count for r in results)} ok of {total} scenarios, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
