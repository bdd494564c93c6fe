"""submitit's local executor: its tasks carry their ranks in ``SUBMITIT_LOCAL_*`` variables, which no launcher reads.

On SLURM, submitit starts its tasks with ``srun`` and the SLURM variables tell each process its rank. Its local
executor sets only its own (``SUBMITIT_LOCAL_NTASKS``, ``SUBMITIT_LOCAL_GLOBALID``, ...): unless the submitted
function exports torch's variables from them (``submitit.helpers.TorchDistributedEnvironment().export()``), every task
would train alone. :func:`check_submitit_tasks` refuses that.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["check_submitit_tasks"]

# Where a launcher (torchrun, srun, submitit's export) said which process this is.
_LAUNCH_VARIABLES = ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")


def check_submitit_tasks(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a task of a multi-task submitit local job that would train alone, for want of torch's variables.

    Args:
        environ: The variables to read (default: ``os.environ``).

    Raises:
        ValueError: If ``SUBMITIT_LOCAL_NTASKS`` is above 1 and no launch variable (``LOCAL_RANK``, ``SLURM_NTASKS``,
            ``TORCHELASTIC_RUN_ID``) is set.

    """
    env = os.environ if environ is None else environ
    tasks = env.get("SUBMITIT_LOCAL_NTASKS", "1")
    if tasks.strip() in ("", "0", "1") or any(name in env for name in _LAUNCH_VARIABLES):
        return
    task = env.get("SUBMITIT_LOCAL_GLOBALID", "?")
    raise ValueError(
        f"This process is task {task} of a submitit local job of SUBMITIT_LOCAL_NTASKS={tasks} tasks, but torch's "
        "launch variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are not set, so each task would "
        "train alone. Start the submitted function with "
        "`submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)` "
        "(see examples/slurm/submit.py)."
    )
