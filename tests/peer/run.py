"""The peer stage: Hugging Face Accelerate's own test files, run against HF accelerate and against lightning_accel.

The files come from the ``accelerate`` sdist on the package index (downloaded once into the cache folder, never
committed). Each side runs them in a pytest process, both sides at the same time (most of these tests use one
core), then the files that bind ``debug_launcher``'s fixed port one side after the other. HF's side imports the
installed accelerate; our side sets ``LIGHTNING_ACCEL_ALIAS=1`` with ``site/`` on ``PYTHONPATH``, so ``accelerate``
is lightning_accel in that process and every process it starts (see ``site/sitecustomize.py``). The stage prints
each file's pass counts side by side and fails when

- a file passes fewer tests on our side than ``floor.json`` records, or
- a test that passes on HF's side fails on ours and ``differences.yaml`` does not give the reason (its keys are test
  ids or patterns of them where ``*`` matches anything, such as ``test_big_modeling::*``).

Usage::

    python tests/peer/run.py                    # both sides, check against the floor
    python tests/peer/run.py --update-floor     # then write the new counts to floor.json
    python tests/peer/run.py --side ours --files test_utils test_scheduler
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SITE = HERE / "site"
FLOOR = HERE / "floor.json"
DIFFERENCES = HERE / "differences.yaml"
VERSION = "1.15.0"
SIDES = ("hf", "ours")
# Run on neither side: ClearML's exit handler waits for its offline repository scan and report flush, which held HF
# accelerate's side for its whole time limit in CI (our ClearMLTracker is compared with HF's in
# tests/unit/tracking/test_trackers_more.py, with repository detection off).
DESELECTED = ("ClearMLTest",)  # test classes, matched as pytest -k keywords
# Files whose tests start processes with ``debug_launcher``, which binds the fixed port 29500: the two sides run the
# other files at the same time (most of their tests use one core), then these one side after the other.
ONE_SIDE_AT_A_TIME = ("test_cpu", "test_scheduler", "test_grad_sync")


@dataclass
class SideResult:
    """Outcome of every test of one side, by test id (``file::Class::test``), and how long the side took."""

    outcomes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, other: SideResult) -> SideResult:
        """This side's outcomes with those of another run of the same side (other files), times added."""
        return SideResult({**self.outcomes, **other.outcomes}, self.seconds + other.seconds)

    def passed(self, file: str) -> set[str]:
        return {tid for tid, outcome in self.outcomes.items() if outcome == "passed" and tid.split("::")[0] == file}


def fetch_tests(cache: Path) -> Path:
    """The sdist's ``tests/`` folder, downloaded into ``cache`` on first use."""
    installed = metadata.version("accelerate")
    if installed != VERSION:
        raise SystemExit(f"The peer stage compares with accelerate=={VERSION}; this environment has {installed}.")
    root = cache / f"accelerate-{VERSION}"
    if (root / "tests").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*download, f"accelerate=={VERSION}", "-d", str(cache)], check=True)
    with tarfile.open(cache / f"accelerate-{VERSION}.tar.gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(f"accelerate-{VERSION}/tests/")]
        archive.extractall(cache, members=members, filter="data")
    return root


def side_environment(side: str, log: Path) -> dict[str, str]:
    """The environment of one side: offline, no inherited Accelerate settings, the alias only on ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "LIGHTNING_ACCEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    if side == "ours":
        env.update(LIGHTNING_ACCEL_ALIAS="1", LIGHTNING_ACCEL_ALIAS_LOG=str(log))
    return env


def run_side(
    side: str,
    root: Path,
    targets: list[str],
    out: Path,
    timeout: int,
    test_timeout: int,
    label: str = "",
    quiet: bool = False,
) -> SideResult:
    """Run ``targets`` (test files or node ids) in one pytest process for ``side``; read its JUnit XML.

    With ``quiet``, pytest's output goes to ``<out>/<side><label>.log`` and is printed, whole, once it ends (for two
    runs at the same time).
    """
    xml, log, output = (out / f"{side}{label}{suffix}" for suffix in (".xml", "-aliased.log", ".log"))
    for path in (xml, log, output):
        path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_plugin", "-o", "addopts="]
    command += ["--continue-on-collection-errors", f"--timeout={test_timeout}", f"--junitxml={xml}", "-rfE"]
    command += ["-k", " and ".join(f"not {name}" for name in DESELECTED)]
    command += targets
    print(f"\n==== {side}{label}: {' '.join(command[2:])}", flush=True)
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(output.open("w")) if quiet else None
        try:
            subprocess.run(
                command,
                cwd=root,
                env=side_environment(side, log),
                timeout=timeout,
                check=False,
                stdout=sink,
                stderr=subprocess.STDOUT if quiet else None,
            )
        except subprocess.TimeoutExpired:
            print(f"==== {side}{label}: stopped after {timeout} s; counting what the JUnit file holds", flush=True)
    if quiet:
        print(f"\n==== {side}{label}: output\n{output.read_text()}", flush=True)
    result = SideResult(seconds=time.monotonic() - start)
    if xml.exists():
        result.outcomes = read_junit(xml)
    return result


def run_both(root: Path, files: list[str], out: Path, timeout: int, test_timeout: int) -> dict[str, SideResult]:
    """Both sides: the files but ``ONE_SIDE_AT_A_TIME`` beside each other, then those one side after the other."""
    together = [f"tests/{name}.py" for name in files if name not in ONE_SIDE_AT_A_TIME]
    apart = [f"tests/{name}.py" for name in files if name in ONE_SIDE_AT_A_TIME]
    results = {side: SideResult() for side in SIDES}
    if together:
        with concurrent.futures.ThreadPoolExecutor(len(SIDES)) as pool:
            runs = {
                side: pool.submit(run_side, side, root, together, out, timeout, test_timeout, quiet=True)
                for side in SIDES
            }
            results = {side: run.result() for side, run in runs.items()}
    for side in SIDES if apart else ():
        results[side] = results[side].add(run_side(side, root, apart, out, timeout, test_timeout, label="-apart"))
    return results


def read_junit(path: Path) -> dict[str, str]:
    """Test id -> ``passed``/``failed``/``skipped`` (a collection error counts as one failed entry for its file)."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = (classname or name).split(".")
        file = next((p for p in parts if p.startswith("test_")), parts[-1])
        owner = classname.split(".")[-1] if classname and classname.split(".")[-1] != file else ""
        tid = "::".join(filter(None, [file, owner, name if classname else "<collection>"]))
        tags = {child.tag for child in case}
        outcomes[tid] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return outcomes


def read_side(out: Path, side: str) -> SideResult:
    """A side's outcomes from its last run's JUnit files (the files run beside the other side's, then the rest)."""
    result = SideResult()
    for xml in (out / f"{side}.xml", out / f"{side}-apart.xml"):
        if xml.exists():
            result = result.add(SideResult(read_junit(xml)))
    return result


def report(files: list[str], results: dict[str, SideResult]) -> list[str]:
    """The Markdown table of pass counts, HF's next to ours."""
    lines = ["| file | HF accelerate passes | lightning_accel passes | HF-passing tests we pass |", "|---|---|---|---|"]
    totals: Counter[str] = Counter()
    for file in files:
        hf, ours = results["hf"].passed(file), results["ours"].passed(file)
        totals.update(hf=len(hf), ours=len(ours), both=len(hf & ours))
        share = f"{len(hf & ours) / len(hf):.0%}" if hf else "-"
        lines.append(f"| {file} | {len(hf)} | {len(ours)} | {share} |")
    share = f"{totals['both'] / totals['hf']:.1%}" if totals["hf"] else "-"
    lines.append(f"| **all** | **{totals['hf']}** | **{totals['ours']}** | **{share}** |")
    return lines


def reason_for(tid: str, reasons: dict[str, str]) -> str | None:
    """The reason ``differences.yaml`` gives for ``tid``: its own entry, else the first pattern that matches it."""
    if tid in reasons:
        return reasons[tid]
    return next((reason for key, reason in reasons.items() if "*" in key and _pattern(key).fullmatch(tid)), None)


def _pattern(key: str) -> re.Pattern[str]:
    """``*`` matches anything; every other character (``[`` of parametrized ids included) stands for itself."""
    return re.compile(".*".join(re.escape(part) for part in key.split("*")))


def check(
    files: list[str], results: dict[str, SideResult], floor: dict[str, int], reasons: dict[str, str]
) -> list[str]:
    """Everything that makes the stage fail: counts below the floor and unexplained differences."""
    problems = []
    for file in files:
        ours = results["ours"].passed(file)
        if len(ours) < floor.get(file, 0):
            problems.append(f"{file}: {len(ours)} tests pass here, below the floor of {floor[file]}")
        for tid in sorted(results["hf"].passed(file) - ours):
            if reason_for(tid, reasons) is None:
                outcome = results["ours"].outcomes.get(tid, "not run")
                problems.append(f"{tid}: passes on HF accelerate, {outcome} here, and differences.yaml gives no reason")
    return problems


def retry_unexplained(
    results: dict[str, SideResult], args: argparse.Namespace, root: Path, out: Path, reasons: dict[str, str]
) -> None:
    """Rerun, on our side, the HF-passing tests that failed here without a listed reason; say which pass now."""
    for attempt in range(args.retries):
        ours = results["ours"]
        unexplained = [
            tid
            for file in args.files
            for tid in sorted(results["hf"].passed(file) - ours.passed(file))
            if reason_for(tid, reasons) is None and not tid.endswith("<collection>")
        ]
        if not unexplained:
            return
        node_ids = [f"tests/{tid.split('::', 1)[0]}.py::{tid.split('::', 1)[1]}" for tid in unexplained]
        rerun = run_side("ours", root, node_ids, out, args.timeout, args.test_timeout, label=f"-retry{attempt + 1}")
        for tid in unexplained:
            if rerun.outcomes.get(tid) == "passed":
                print(f"flaky: {tid} failed here, then passed on retry {attempt + 1}")
                ours.outcomes[tid] = "passed"


def main(argv: list[str] | None = None) -> int:
    """Run the stage; the exit status is 1 when a check fails."""
    floor: dict[str, int] = json.loads(FLOOR.read_text())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(floor), help="Accelerate test files, without .py")
    parser.add_argument("--side", choices=[*SIDES, "both"], default="both")
    parser.add_argument("--cache", type=Path, default=ROOT / ".peer-cache", help="where the sdist and results go")
    parser.add_argument("--timeout", type=int, default=2400, help="seconds for one side")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for one test")
    parser.add_argument("--update-floor", action="store_true", help="write our pass counts to floor.json")
    parser.add_argument("--retries", type=int, default=1, help="reruns of unexplained failures (flaky tests)")
    parser.add_argument(
        "--reuse", choices=SIDES, help="read this side's outcomes from the last run instead of running it"
    )
    args = parser.parse_args(argv)

    root = fetch_tests(args.cache)
    out = args.cache / "results"
    out.mkdir(parents=True, exist_ok=True)
    sides = SIDES if args.side == "both" else (args.side,)
    targets = [f"tests/{name}.py" for name in args.files]
    if len(sides) == len(SIDES) and args.reuse is None:
        results = run_both(root, args.files, out, args.timeout, args.test_timeout)
    else:
        results = {
            side: read_side(out, side)
            if side == args.reuse
            else run_side(side, root, targets, out, args.timeout, args.test_timeout)
            for side in sides
        }
    for side, result in results.items():
        print(f"==== {side}: {len(result.outcomes)} tests in {result.seconds:.0f} s")
    if args.side != "both":
        return 0
    table = report(args.files, results)
    (out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))
    reasons: dict[str, str] = yaml.safe_load(DIFFERENCES.read_text()) or {}
    if args.retries:
        retry_unexplained(results, args, root, out, reasons)
    stale = sorted(tid for tid in reasons if results["ours"].outcomes.get(tid) == "passed")  # patterns never stale
    for tid in stale:
        print(f"note: {tid} passes here now; remove it from differences.yaml")
    if args.update_floor:
        floor.update({file: len(results["ours"].passed(file)) for file in args.files})
        FLOOR.write_text(json.dumps(floor, indent=2) + "\n")
    problems = check(args.files, results, floor, reasons)
    for problem in problems:
        print(f"FAIL {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
