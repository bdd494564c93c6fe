"""Submit ``train_trainer.py`` or ``train_accelerator.py`` to SLURM with submitit instead of an sbatch script.

submitit starts one task per process (``tasks_per_node``) and runs :func:`train` in each. Its local executor (the
same code path on one machine, without SLURM) conveys the ranks in its own variables (``SUBMITIT_LOCAL_GLOBALID``,
``SUBMITIT_LOCAL_NTASKS``, ...), which no launcher reads; :func:`train` therefore first calls submitit's
``TorchDistributedEnvironment().export()``, which sets torch's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from either executor's job environment. ``Accelerator()``
and ``Trainer(strategy="acc_ddp")`` then form one process group of all the tasks.

    python examples/slurm/submit.py trainer --partition gpu -- --root runs/trainer --devices 2 --num_nodes 2
    python examples/slurm/submit.py accelerator --local -- --project runs/loop   # 2 tasks on this machine

Arguments after ``--`` go to the training script. Tested by ``tests/launch/test_slurm.py`` (``LocalExecutor``, 2 tasks).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

import submitit
from submitit.helpers import TorchDistributedEnvironment

HERE = Path(__file__).parent


def train(kind: str, argv: Sequence[str]) -> None:
    """One task of the job: torch's launch variables from submitit's job environment, then the training script."""
    # overwrite: a MASTER_PORT set before submitting is read (as the port) and then kept; CUDA_VISIBLE_DEVICES is left
    # whole, since Lightning picks each process's device by its local rank.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    script = runpy.run_path(str(HERE / f"train_{kind}.py"), run_name="submitit_task")
    script["main"](list(argv))


def main() -> None:
    argv = sys.argv[1:]
    ours, script_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("trainer", "accelerator"))
    parser.add_argument("--local", action="store_true", help="run the tasks on this machine (LocalExecutor)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks_per_node", type=int, default=2)
    parser.add_argument("--logs", default="submitit_logs")
    args = parser.parse_args(ours)
    executor = submitit.AutoExecutor(folder=args.logs, cluster="local" if args.local else None)
    executor.update_parameters(nodes=args.nodes, tasks_per_node=args.tasks_per_node, timeout_min=60)
    if args.partition is not None:
        executor.update_parameters(slurm_partition=args.partition)
    job = executor.submit(train, args.kind, script_args)
    print(f"submitted job {job.job_id}; logs in {args.logs}")
    job.results()  # one result per task; raises with the failing task's traceback


if __name__ == "__main__":
    main()
