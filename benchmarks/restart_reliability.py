"""How often a killed worker's restart ends bit-identical to an uninterrupted run, per launch topology.

Each try runs ``tests/scripts/faults_restart.py`` (2 CPU processes, a Trainer with ``CheckpointRotation`` and
``SeedableSampler``) under ``lightning-accel launch --max_restarts 1``, SIGKILLs rank 1 at step 5 and compares the
final weights with one uninterrupted run. Topologies (see ``tests/restarts.py``): one machine without a port
(``c10d`` rendezvous), one machine with a fixed port and two loopback "nodes" (both ``static``).

    python benchmarks/restart_reliability.py --tries 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import restarts  # the repository root is on the path from here on


def _try(topology: str, root: Path, reference: Path, timeout: float) -> str:
    try:
        restarts.run(topology, root / "project", root / "weights.pt", kill_at_step=5, timeout=timeout)
    except AssertionError as err:
        return "failed: " + str(err).splitlines()[0]
    differing = restarts.mismatches(reference, root / "weights.pt")
    return f"differs: {', '.join(differing)}" if differing else "identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10, help="kill-and-restart runs per topology")
    parser.add_argument("--topology", choices=restarts.TOPOLOGIES, action="append", help="default: all three")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        restarts.run("standalone", root / "reference", root / "reference.pt", timeout=args.timeout)
        for topology in args.topology or restarts.TOPOLOGIES:
            outcomes = []
            for index in range(args.tries):
                start = time.perf_counter()
                outcome = _try(topology, root / f"{topology}_{index}", root / "reference.pt", args.timeout)
                outcomes.append(outcome)
                print(f"{topology} try {index + 1}: {outcome} ({time.perf_counter() - start:.0f} s)", flush=True)
            print(f"{topology}: {outcomes.count('identical')} of {args.tries} bit-identical", flush=True)


if __name__ == "__main__":
    main()
