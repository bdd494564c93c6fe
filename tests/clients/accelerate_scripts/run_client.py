"""The ``accelerate_scripts`` client: Accelerate's shipped multi-process test scripts, per test function.

Accelerate ships the scripts its multi-process tests launch inside the package (``accelerate/test_utils/scripts/``).
Each runs here at 2 CPU processes over gloo, launched the way Accelerate's tests launch it (``torch.distributed.run``,
or plain ``python`` with ``ACCELERATE_NUM_PROCESSES=2`` for the notebook launcher's script), once with HF accelerate
and once with ``accelerate`` resolved to lightning_accel (``LIGHTNING_ACCEL_ALIAS=1`` with ``tests/peer/site`` on
``PYTHONPATH``). ``per_function.py`` runs each script's own main block and records every test function it calls, so
each function is one scenario: ok when it passes on both sides. The external_deps scripts that load ``bert-base-cased``
and GLUE/MRPC by hub name run beside tiny offline stand-ins of those (``offline/build.py``), unmodified.

Then our own example-style programs (``examples/``, written from what Accelerate's ``examples/`` do) train a tiny
random BERT classifier at 2 processes under both libraries, and their final weights are compared bit for bit.

Usage: ``python tests/clients/accelerate_scripts/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SITE = ROOT / "tests" / "peer" / "site"
CLIENT = "accelerate_scripts"
SIDES = ("hf", "ours")
REFERENCE = f"hf accelerate {metadata.version('accelerate')}"


@dataclass(frozen=True)
class Script:
    """One shipped script and how Accelerate's tests launch it."""

    path: str
    launcher: str = "torchrun"
    timeout: int = 240
    env: dict[str, str] = field(default_factory=dict)
    not_run: str = ""
    #: Loads ``bert-base-cased`` and GLUE/MRPC by hub name: run beside the offline stand-ins (``offline/build.py``).
    offline: bool = False
    args: tuple[str, ...] = ()
    #: Scenario name when one script runs more than once (default: its path without ``.py``).
    name: str = ""
    #: Name of the earlier run whose working directory (checkpoints included) this run starts from.
    after: str = ""

    @property
    def label(self) -> str:
        return self.name or self.path.removesuffix(".py")


SCRIPTS = [
    Script("test_script.py"),
    Script("test_ops.py"),
    Script("test_sync.py"),
    # HF accelerate does not join on CPU, so its uneven-input cases wait for the process-group timeout: keep it short.
    Script("test_distributed_data_loop.py", env={"CLIENT_PG_TIMEOUT": "30"}),
    Script("test_ddp_comm_hook.py"),
    Script("test_merge_weights.py"),
    Script("test_notebook.py", launcher="python", env={"ACCELERATE_NUM_PROCESSES": "2", "OMP_NUM_THREADS": "1"}),
    Script("external_deps/test_metrics.py"),
    # As Accelerate's tests run it: train a partial run that saves epoch_0, then resume it in a fresh launch.
    Script("external_deps/test_checkpointing.py", offline=True, args=("--partial_train_epoch", "1")),
    Script(
        "external_deps/test_checkpointing.py",
        args=("--resume_from_checkpoint", "epoch_0"),
        name="external_deps/test_checkpointing_resume",
        after="external_deps/test_checkpointing",
    ),
    Script("external_deps/test_performance.py", offline=True),
    Script("external_deps/test_peak_memory_usage.py", not_run="measures accelerator memory only: fails on any CPU"),
    Script(
        "external_deps/test_ds_multiple_model.py",
        not_run="reads DeepSpeed configs from Accelerate's repository checkout, not shipped in the package",
    ),
    Script("external_deps/test_zero3_integration.py", not_run="initialises an NCCL process group: needs CUDA"),
    Script("external_deps/test_ds_alst_ulysses_sp.py", not_run="loads a Llama from the hub; needs CUDA"),
    Script("external_deps/test_pippy.py", not_run="pipeline parallelism needs CUDA devices"),
]


def offline_assets(work: Path) -> Path:
    """The tiny offline model, tokenizer, MRPC and metric (``offline/build.py``), built once per work folder."""
    assets = work / "offline-assets"
    if not (assets / "glue" / "glue.py").exists():
        shutil.rmtree(assets, ignore_errors=True)
        env = side_environment("hf", {})
        subprocess.run([sys.executable, str(HERE / "offline" / "build.py"), str(assets)], env=env, check=True)
    return assets


def link_assets(assets: Path, folder: Path) -> None:
    """Put the stand-ins where the scripts' hub names resolve: their working directory."""
    for entry in assets.iterdir():
        (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def scripts_folder() -> Path:
    """Accelerate's shipped scripts, from the installed HF accelerate (without importing it)."""
    spec = metadata.distribution("accelerate").locate_file("accelerate/test_utils/scripts")
    return Path(str(spec))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def side_environment(side: str, extra: dict[str, str]) -> dict[str, str]:
    """Offline, no inherited Accelerate settings; on our side ``accelerate`` is lightning_accel."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "LIGHTNING_ACCEL_"))}
    paths = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    if side == "ours":
        paths.insert(0, str(SITE))
        env["LIGHTNING_ACCEL_ALIAS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # What ``accelerate launch --cpu`` sets: HF's PartialState is MULTI_CPU under torchrun only with it.
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def launch(command: list[str], cwd: Path, env: dict[str, str], timeout: int, log: Path) -> str:
    """Run one program in its own session; '' when it ended in time, else a note that it was stopped."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=timeout)
            return ""
        except subprocess.TimeoutExpired:
            # torchrun forwards SIGTERM to its workers (they run in sessions of their own); then make sure.
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return f"stopped after {timeout} s"


def torchrun(program: list[str]) -> list[str]:
    port = free_port()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        *program,
    ]


def read_outcomes(folder: Path, ranks: int) -> dict[str, tuple[str, str]]:
    """Function id -> (outcome, detail) over all ranks: passed only when every rank passed it."""
    per_rank: list[dict[str, dict[str, str]]] = []
    for rank in range(ranks):
        path = folder / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        per_rank.append({row["id"]: row for row in map(json.loads, lines)})
    ids = list(dict.fromkeys(i for rows in per_rank for i in rows))
    result: dict[str, tuple[str, str]] = {}
    for test_id in ids:
        rows = [rows.get(test_id) for rows in per_rank]
        failed = [(rank, row) for rank, row in enumerate(rows) if row is None or row["outcome"] == "failed"]
        if failed:
            rank, row = failed[0]
            result[test_id] = ("failed", f"rank {rank}: {row['error'] if row else 'not reached'}")
        elif all(row is not None and row["outcome"] == "skipped" for row in rows):
            result[test_id] = ("skipped", rows[0]["error"] if rows[0] else "")
        else:
            result[test_id] = ("passed", "")
    return result


def run_script(script: Script, side: str, work: Path) -> tuple[dict[str, tuple[str, str]], str]:
    """Outcomes of one script on one side, and a note when its launch was stopped."""
    name = script.label
    folder = work / side / name
    shutil.rmtree(folder, ignore_errors=True)
    if script.after:
        ignore = shutil.ignore_patterns("outcomes", "log.txt")
        shutil.copytree(work / side / script.after, folder, symlinks=True, ignore=ignore)
    folder.mkdir(parents=True, exist_ok=True)
    if script.offline:
        link_assets(offline_assets(work), folder)
    program = [str(HERE / "per_function.py"), str(scripts_folder() / script.path), str(folder / "outcomes")]
    program += script.args
    command = torchrun(program) if script.launcher == "torchrun" else [sys.executable, *program]
    start = time.monotonic()
    env = side_environment(side, script.env)
    if script.offline or script.after:
        # datasets caches a local dataset under its name: keep the caches in the run's folder, never stale.
        env["HF_HOME"] = str(folder / "hf-home")
    note = launch(command, folder, env, script.timeout, folder / "log.txt")
    print(f"  {side:4} {name}: {time.monotonic() - start:.0f} s {note}", flush=True)
    ranks = 2 if script.launcher == "torchrun" else 1
    return read_outcomes(folder / "outcomes", ranks), note


def compare_script(script: Script, work: Path, only: str) -> list[dict[str, object]]:
    """One scenario per test function the script called on either side."""
    name = script.label
    if not fnmatch.fnmatch(f"{CLIENT}::{name}::x", only) and not fnmatch.fnmatch(f"{CLIENT}::{name}", only):
        return []
    if script.not_run:
        detail = f"not run: {script.not_run}"
        return [scenario(f"{name}::*", "passes", ok=False, detail=detail)]
    results = {side: run_script(script, side, work) for side in SIDES}
    ids = list(dict.fromkeys([*results["hf"][0], *results["ours"][0]]))
    rows = []
    for test_id in ids:
        hf, ours = (results[side][0].get(test_id, ("failed", f"not reached {results[side][1]}")) for side in SIDES)
        ok = hf[0] == ours[0] == "passed"
        detail = f"hf {hf[0]}{': ' + hf[1] if hf[1] else ''}; ours {ours[0]}{': ' + ours[1] if ours[1] else ''}"
        rows.append(scenario(f"{name}::{test_id}", "passes", ok=ok, detail=detail))
    return rows


def scenario(sid: str, comparison: str, *, ok: bool, detail: str, reference: str = REFERENCE) -> dict[str, object]:
    return {"id": f"{CLIENT}::{sid}", "reference": reference, "comparison": comparison, "ok": ok, "detail": detail}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--only", default="*")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="clients-accelerate-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rows: list[dict[str, object]] = []
    for script in SCRIPTS:
        rows += compare_script(script, work.resolve(), args.only)
    from examples_compare import compare_examples

    rows += compare_examples(work.resolve(), args.only, side_environment, launch, torchrun, scenario)
    result = {"client": CLIENT, "seconds": round(time.monotonic() - start, 1), "scenarios": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    ok = sum(bool(row["ok"]) for row in rows)
    print(f"{CLIENT}: {ok} of {len(rows)} scenarios ok in {result['seconds']} s; work folder {work}")
    for row in rows:
        print(f"  {'ok ' if row['ok'] else 'NOT'} {row['id']}  {row['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
