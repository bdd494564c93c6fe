"""Accelerate-style checkpoint rotation: `checkpoint_{iteration}` names, the newest `total_limit` kept."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks.rng import gather_rng_states, restore_rng_states, states_for_rank
from lightning_accel.checkpoint.folders import (
    SaveTarget,
    numbered_checkpoints,
    on_disk_managers,
    publish,
    remove_incomplete,
    rotate,
)
from lightning_accel.checkpoint.node_copies import complete_on_each_node
from lightning_accel.config import ProjectConfiguration
from lightning_accel.config._validation import check_positive_int
from lightning_accel.lightning_compat import (
    get_checkpoint_connector,
    get_every_n_epochs,
    get_every_n_train_steps,
    get_last_global_step_saved,
    get_should_accumulate,
    lightning_private_members,
    set_fs,
    set_last_checkpoint_saved,
    set_last_global_step_saved,
)
from lightning_accel.strategies.checkpoint_io import AsyncNamingCheckpointIO

__all__ = ["CheckpointRotation", "complete_checkpoints", "latest_checkpoint"]


def _checkpoints_dir(project_dir: str | os.PathLike[str]) -> Path:
    return Path(project_dir) / "checkpoints"


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete ``checkpoint_{i}`` entries (files or folders) of ``directory``, oldest (lowest ``i``) first.

    A checkpoint being written has a temporary name (``.checkpoint_{i}.incomplete``) until it is complete, so it is
    never listed here.
    """
    return [entry for _, entry in numbered_checkpoints(directory, folders_only=False)]


def latest_checkpoint(project_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint written by :class:`CheckpointRotation` for ``project_dir``, or ``None``.

    Example:
        >>> trainer.fit(model, ckpt_path=latest_checkpoint("runs/exp1"))  # doctest: +SKIP

    """
    found = complete_checkpoints(_checkpoints_dir(project_dir))
    return str(found[-1]) if found else None


@lightning_private_members("_generate_state_key", "_find_last_checkpoints")
class CheckpointRotation(ModelCheckpoint):
    """Save ``project_dir/checkpoints/checkpoint_{iteration}`` on a cadence and keep the newest ``total_limit``.

    The names, the numbering (from ``ProjectConfiguration.iteration``, 0 by default) and the rotation are
    Accelerate's ``save_state`` with ``automatic_checkpoint_naming=True``: with ``total_limit=2``, four saves leave
    ``checkpoint_2`` and ``checkpoint_3``. A checkpoint is whatever the strategy writes: a file for DDP, a folder for
    sharded strategies. What differs from Accelerate, on purpose:

    * a checkpoint is written under a temporary name (``.checkpoint_{i}.incomplete``) and renamed when complete;
      only then are old ones deleted, so an interrupted save (even SIGKILL) leaves every earlier checkpoint intact,
      and a temporary one is never picked for resume (it is removed at the next ``fit``);
    * the iteration counter is saved in each checkpoint and restored on resume, so numbering continues; the
      checkpoints on disk are listed at every save, so the limit still holds after a resume;
    * ``trainer.fit(..., ckpt_path="last")`` resumes from the newest complete checkpoint (see
      :func:`latest_checkpoint`);
    * every process's RNG states (python, numpy, torch, CUDA) are gathered into each checkpoint and restored in
      ``on_train_start`` of a run with the same number of processes, which makes resume bit-exact together with
      :class:`~lightning_accel.callbacks.SeedableSampler` (resuming exactly also needs the accumulation window to be
      closed when the checkpoint is taken; a warning says when it is not).

    With :class:`~lightning_accel.strategies.checkpoint_io.AsyncNamingCheckpointIO` as the strategy's checkpoint I/O
    (``Trainer(plugins=[AsyncNamingCheckpointIO()])``), the checkpoint is written in the background and the rename
    and the deletion of old ones run once the write has landed: in the writer thread for a file, in the next save (or
    the end of ``fit``) for a sharded directory, once every process has written its shards. A save killed in the
    background leaves every earlier checkpoint intact and the newest of them the one ``ckpt_path="last"`` resumes
    from.

    Only the global-rank-0 process renames and deletes. With ``save_on_each_node=True`` the local-rank-0 process of
    every other node does the same afterwards on its own disk, and writes its own copy when the node cannot see the
    one written by the strategy (storage that is not shared between nodes). A sharded checkpoint (a folder) is made
    whole on each node's disk before it is renamed: the shards and metadata a node lacks are sent to it by a node
    that has them (nothing moves on shared storage). Paths are local filesystem paths.

    Args:
        project_config: ``project_dir`` (required), ``total_limit``, ``iteration``, ``save_on_each_node``;
            ``automatic_checkpoint_naming`` must be ``True``. ``project_config.iteration`` advances with every save.
        every_n_train_steps: Save every this many optimizer steps (``trainer.global_step``).
        every_n_epochs: Save at the end of every this many training epochs.

    Raises:
        TypeError: If ``project_config`` is not a ``ProjectConfiguration``.
        ValueError: If ``project_dir`` is missing, ``automatic_checkpoint_naming`` is off, ``total_limit`` is not a
            positive integer or ``None``, or not exactly one cadence is a positive integer.

    Example:
        >>> from lightning_accel.config import ProjectConfiguration
        >>> rotation = CheckpointRotation(  # doctest: +SKIP
        ...     ProjectConfiguration("runs/exp1", automatic_checkpoint_naming=True, total_limit=3),
        ...     every_n_train_steps=100,
        ... )

    """

    FILE_EXTENSION = ""

    def __init__(
        self,
        project_config: ProjectConfiguration,
        *,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
    ) -> None:
        _check_project_config(project_config)
        _check_cadence(every_n_train_steps, every_n_epochs)
        assert project_config.project_dir is not None
        self.project_config = project_config
        self._directory = _checkpoints_dir(project_config.project_dir)
        super().__init__(
            dirpath=self._directory,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            save_top_k=-1,
            save_last=False,
            enable_version_counter=False,
        )
        self._saved_rng_states: list[dict[str, Any]] | None = None
        self._warned_mid_window = False

    @property
    def directory(self) -> Path:
        """``project_dir/checkpoints``."""
        return self._directory

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(project_dir=self.project_config.project_dir)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a background checkpoint I/O this callback cannot follow; clean up saves that were killed.

        Raises:
            ValueError: If the strategy's checkpoint I/O is Lightning's ``AsyncCheckpointIO``, or
                :class:`~lightning_accel.strategies.checkpoint_io.AsyncNamingCheckpointIO` with
                ``save_on_each_node=True``.

        """
        _check_async_io(trainer.strategy.checkpoint_io, self.project_config)
        set_fs(self, get_filesystem(self._directory))
        if stage == "fit":
            self._on_managers(trainer, lambda: remove_incomplete(self._directory))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_last_global_step_saved(self, trainer.global_step)
        if self._saved_rng_states is None:
            return
        states = states_for_rank(self._saved_rng_states, trainer.global_rank, trainer.world_size)
        self._saved_rng_states = None
        if states is None:
            rank_zero_warn(
                "CheckpointRotation: the checkpoint holds RNG states of a run with a different number of processes;"
                f" this run has {trainer.world_size}, so RNG states are not restored and the resumed run will not"
                " repeat the original bit for bit."
            )
            return
        # Restored as late as possible: the sanity check and the first iterator are already behind us.
        restore_rng_states(states)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, every = trainer.global_step, get_every_n_train_steps(self)
        if every < 1 or self._skip(trainer) or step == get_last_global_step_saved(self):
            return
        if step % every == 0:
            self.save(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = get_every_n_epochs(self)
        if every < 1 or self._skip(trainer):
            return
        if (trainer.current_epoch + 1) % every == 0:
            self.save(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Saves happen on the training cadence only."""

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.project_config.iteration,
            "last_model_path": self.last_model_path,
            "project_dir": self.project_config.project_dir,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.project_config.iteration = state_dict["iteration"]
        self.last_model_path = self.best_model_path = state_dict["last_model_path"]
        self._saved_rng_states = state_dict.get("rng_states")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Collective: every process dumps the checkpoint, so every process takes part.
        rng_states = gather_rng_states()
        if "callbacks" in checkpoint:
            checkpoint["callbacks"].setdefault(self.state_key, self.state_dict())["rng_states"] = rng_states

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning resolves `ckpt_path="last"` through this method of every ModelCheckpoint.
        found = complete_checkpoints(self._directory)
        return {str(found[-1])} if found else set()

    def save(self, trainer: pl.Trainer) -> str:
        """Write the next checkpoint now, then rotate. Every process must call it.

        Returns:
            The path of the new checkpoint.

        Raises:
            ValueError: If ``checkpoint_{iteration}`` already exists (a fresh run in a used project directory).

        """
        index = self.project_config.iteration
        target = SaveTarget(self._directory / f"checkpoint_{index}")
        final = target.final
        if trainer.strategy.broadcast(final.exists(), src=0):
            raise ValueError(
                f"{final} already exists. Resume with `trainer.fit(..., ckpt_path='last')` to continue its"
                " numbering, start from another iteration with ProjectConfiguration(iteration=...), or use an empty"
                " project_dir."
            )
        self._warn_if_mid_window(trainer)
        # Saved inside this checkpoint: a run resumed from it writes the next index.
        self.project_config.iteration = index + 1
        self._write(trainer, target.temporary)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncNamingCheckpointIO):  # written by global rank 0's thread: renamed there once landed
            if trainer.is_global_zero:
                io.then(lambda: self._publish_and_rotate(target))
        else:
            self._on_managers(trainer, lambda: publish(target))
            self._on_managers(trainer, self._rotate)
        self._record(trainer, str(final))
        return str(final)

    def _write(self, trainer: pl.Trainer, temporary: Path) -> None:
        checkpoint = get_checkpoint_connector(trainer).dump_checkpoint(weights_only=False)
        trainer.strategy.save_checkpoint(checkpoint, temporary)
        trainer.strategy.barrier("CheckpointRotation.write")
        if self._is_other_node_manager(trainer) and not temporary.exists():
            trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, temporary)
        trainer.strategy.barrier("CheckpointRotation.write_node_copies")
        if self.project_config.save_on_each_node:  # a sharded folder: each node gets the shards it lacks
            complete_on_each_node(temporary, node_manager=trainer.local_rank == 0, what="CheckpointRotation")

    def _publish_and_rotate(self, target: SaveTarget) -> None:
        publish(target)
        self._rotate()

    def _rotate(self) -> None:
        rotate(self._directory, self.project_config.total_limit, folders_only=False)

    def _record(self, trainer: pl.Trainer, path: str) -> None:
        set_last_global_step_saved(self, trainer.global_step)
        set_last_checkpoint_saved(self, path)
        self.last_model_path = self.best_model_path = path
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _on_managers(self, trainer: pl.Trainer, action: Callable[[], None]) -> None:
        """Run a filesystem ``action`` on global rank 0, then on the other nodes' local rank 0 if each node saves.

        Collective; an error of the action is raised on every process, so none waits for the one that failed.
        """
        on_disk_managers(
            action,
            is_main=trainer.is_global_zero,
            other_node_manager=self._is_other_node_manager(trainer),
            what="CheckpointRotation",
            barrier=lambda: trainer.strategy.barrier("rotation"),
        )

    def _is_other_node_manager(self, trainer: pl.Trainer) -> bool:
        return self.project_config.save_on_each_node and trainer.local_rank == 0 and not trainer.is_global_zero

    def _skip(self, trainer: pl.Trainer) -> bool:
        return (
            bool(getattr(trainer, "fast_dev_run", False))
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
        )

    def _warn_if_mid_window(self, trainer: pl.Trainer) -> None:
        if self._warned_mid_window or not get_should_accumulate(trainer.fit_loop)():
            return
        self._warned_mid_window = True
        rank_zero_warn(
            "CheckpointRotation saved in the middle of a gradient-accumulation window; the accumulated gradients are"
            " not part of a checkpoint, so a run resumed from it will not repeat the original exactly. Save on a"
            " cadence that ends windows (every_n_train_steps, or every_n_epochs with sync_with_dataloader=True)."
        )


def _check_project_config(project_config: object) -> None:
    if not isinstance(project_config, ProjectConfiguration):
        raise TypeError(
            f"CheckpointRotation(project_config=...) takes a ProjectConfiguration, got"
            f" {type(project_config).__name__}: {project_config!r}."
        )
    if project_config.project_dir is None:
        raise ValueError(
            "CheckpointRotation needs a directory: pass ProjectConfiguration(project_dir=...,"
            " automatic_checkpoint_naming=True)."
        )
    if not project_config.automatic_checkpoint_naming:
        raise ValueError(
            "CheckpointRotation names checkpoints itself (checkpoint_{iteration}, Accelerate's automatic naming), but"
            " ProjectConfiguration(automatic_checkpoint_naming=False) was given; set it to True, or use Lightning's"
            " ModelCheckpoint(filename=...) to choose names yourself."
        )
    limit = project_config.total_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"ProjectConfiguration(total_limit={limit!r}) must be a positive integer (checkpoints to keep) or None to"
            " keep every checkpoint."
        )


def _check_async_io(checkpoint_io: object, project_config: ProjectConfiguration) -> None:
    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "CheckpointRotation cannot follow Lightning's AsyncCheckpointIO: it would rename the checkpoint before the"
            " background write landed. Use plugins=[lightning_accel.strategies.AsyncNamingCheckpointIO()] instead."
        )
    if isinstance(checkpoint_io, AsyncNamingCheckpointIO) and project_config.save_on_each_node:
        raise ValueError(
            "CheckpointRotation with ProjectConfiguration(save_on_each_node=True) copies each checkpoint to every"
            " node, which needs the checkpoint complete at the save; AsyncNamingCheckpointIO writes it later. Drop"
            " AsyncNamingCheckpointIO from the Trainer's plugins, or set save_on_each_node=False."
        )


def _check_cadence(every_n_train_steps: int | None, every_n_epochs: int | None) -> None:
    if every_n_train_steps is None and every_n_epochs is None:
        raise ValueError(
            "CheckpointRotation needs a cadence: pass every_n_train_steps=N (optimizer steps) or every_n_epochs=N."
        )
    if every_n_train_steps is not None and every_n_epochs is not None:
        raise ValueError(
            f"CheckpointRotation got every_n_train_steps={every_n_train_steps} and every_n_epochs={every_n_epochs};"
            " pass only one of them."
        )
    check_positive_int("CheckpointRotation(every_n_train_steps)", every_n_train_steps, optional=True)
    check_positive_int("CheckpointRotation(every_n_epochs)", every_n_epochs, optional=True)
