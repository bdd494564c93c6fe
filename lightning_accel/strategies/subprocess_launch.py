"""Lightning's subprocess launcher, telling the ranks it starts whom to follow (see ``launch_settings/orphans``).

Lightning's ``_SubprocessScriptLauncher`` runs rank 0 in the user's process and starts the other ranks of the machine
as its children; it watches them, but they do not watch it. :func:`follow_lightnings_launcher` swaps the launcher an
``acc_*`` strategy got from Lightning for one that records its process id for the children when it starts them, and,
in a child, starts the watch that ends it once rank 0 has ended. :class:`FollowsTheLauncher` does it for every
multi-process family (DDP, FSDP, DeepSpeed, ``acc_parallel``, Megatron), once Lightning has chosen the launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessLauncher,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _TrainerSubprocessLauncher,
)

from lightning_accel.launch_settings.orphans import mark_launcher, watch_launcher
from lightning_accel.lightning_compat import set_lightning_private

__all__ = ["FollowsTheLauncher", "follow_lightnings_launcher"]


class _Launched(Protocol):
    """The parts of a Lightning strategy whose launcher is swapped."""

    cluster_environment: ClusterEnvironment | None

    @property
    def launcher(self) -> object: ...


class _Launching(Protocol):
    cluster_environment: ClusterEnvironment


class _MarksItsChildren:
    """Before Lightning's subprocess launcher (Trainer's or Fabric's): record this process's id for its children."""

    def launch(self: _Launching, function: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            mark_launcher()  # beside Lightning's own MASTER_ADDR, NODE_RANK, ... set for the children
        return super().launch(function, *args, **kwargs)  # type: ignore[misc]  # Lightning's, next in the MRO


class _MarkingTrainerLauncher(_MarksItsChildren, _TrainerSubprocessLauncher):
    """Lightning's Trainer launcher, which records its process id in the environment its children inherit."""


class _MarkingFabricLauncher(_MarksItsChildren, _FabricSubprocessLauncher):
    """Lightning's Fabric launcher, which records its process id in the environment its children inherit."""


def follow_lightnings_launcher(strategy: _Launched) -> None:
    """After Lightning chose ``strategy``'s launcher: mark the ranks it starts, or, in such a rank, watch rank 0."""
    launcher = strategy.launcher
    environment = strategy.cluster_environment
    if environment is not None and environment.creates_processes_externally:
        watch_launcher(environment.local_rank())
        return
    for lightnings, ours in (
        (_TrainerSubprocessLauncher, _MarkingTrainerLauncher),
        (_FabricSubprocessLauncher, _MarkingFabricLauncher),
    ):
        if type(launcher) is lightnings:
            assert isinstance(launcher, lightnings)
            swapped = ours(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
            set_lightning_private(strategy, "_launcher", swapped)


class FollowsTheLauncher:
    """Among a family adapter's bases (before Lightning's strategy): Lightning's launcher, then the follow-up."""

    def _configure_launcher(self: _Launched) -> None:
        super()._configure_launcher()  # type: ignore[misc]  # Lightning's, after this class in the MRO
        follow_lightnings_launcher(self)
