"""Gradient accumulation with Accelerate's windows: step every ``num_steps`` batches and at the end of the data."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel.callbacks._patching import InstancePatch
from lightning_accel.config import GradientAccumulationPlugin
from lightning_accel.config._validation import check_bool, check_positive_int
from lightning_accel.lightning_compat import get_make_zero_grad_fn, lightning_private_members

__all__ = ["GradientAccumulation", "MicroBatch", "plan_micro_batch"]


@dataclass(frozen=True)
class MicroBatch:
    """What happens around one training batch of an accumulation window.

    Attributes:
        starts_window: Whether the gradients are zeroed before this batch's backward.
        steps: Whether the optimizer steps (and gradients are synchronised) after this batch.
        window_size: The number of batches in this batch's window; the loss is divided by it.

    """

    starts_window: bool
    steps: bool
    window_size: int


def plan_micro_batch(
    num_steps: int,
    *,
    sync_with_dataloader: bool,
    batch_idx: int,
    total_batch_idx: int,
    epoch_length: int | None,
    is_last_batch: bool,
) -> MicroBatch:
    """Place one batch in its accumulation window, the way Accelerate's ``accumulate()`` does.

    With ``sync_with_dataloader`` windows restart with every epoch and the last batch of an epoch always steps, so an
    epoch of 5 batches with ``num_steps=2`` steps after batches 1, 3 and 4 (the last window holds one batch). Without
    it, windows are counted over all batches seen and carry across epochs.

    Args:
        num_steps: Batches per window.
        sync_with_dataloader: Whether windows restart with each epoch.
        batch_idx: The batch index within the epoch (0-based).
        total_batch_idx: The batch index over all epochs (0-based).
        epoch_length: Batches in the epoch, or ``None`` when the loader has no length.
        is_last_batch: Whether this is the epoch's last batch (known one batch ahead through prefetching).

    Returns:
        The batch's role in its window. Without an epoch length, the size of a short final window is unknown until
        its last batch, so ``window_size`` stays ``num_steps`` there.

    """
    if not sync_with_dataloader:
        position = total_batch_idx % num_steps
        return MicroBatch(position == 0, position == num_steps - 1, num_steps)
    start = batch_idx - batch_idx % num_steps
    position = batch_idx - start
    size = num_steps if epoch_length is None else min(num_steps, epoch_length - start)
    return MicroBatch(position == 0, position == size - 1 or is_last_batch, size)


@lightning_private_members("_generate_state_key")
class GradientAccumulation(Callback):
    """Accumulate gradients over ``num_steps`` batches with Accelerate's semantics, under any strategy.

    Compared with ``Trainer(accumulate_grad_batches=k)``:

    * ``sync_with_dataloader=False`` carries a window across the epoch boundary (Lightning restarts at every epoch and
      always steps on an epoch's last batch);
    * the loss is divided by the true size of the current window, so a short last window (5 batches with
      ``num_steps=2`` end with a window of 1) is not scaled down by ``num_steps``. Accelerate 1.15 divides by
      ``num_steps`` there, like Lightning; both are off by ``window/num_steps`` for that step, which this fixes;
    * ``sync_each_batch=True`` synchronises gradients on every micro-batch (less memory, more communication) by
      replacing the strategy's ``block_backward_sync`` with a no-op for the fit (DDP, FSDP1, FSDP2). Under
      ``acc_deepspeed`` that context is DeepSpeed's accumulation boundary (the engine's step signal), so it stays, as
      in Accelerate: ZeRO 2/3 reduce every micro-batch into their partitions anyway, ZeRO 0/1 at the step;
    * under a strategy that accumulates itself (``strategy.handles_gradient_accumulation``, e.g. DeepSpeed),
      ``num_steps`` is handed to it through ``trainer.accumulate_grad_batches`` in :meth:`setup`, before the
      strategy builds its engine, instead of being refused as Lightning's ``GradientAccumulationScheduler`` does.
      The engine then owns windows and loss scaling.

    Step-interval schedulers step once per optimizer step. ``adjust_scheduler`` exists for signature parity with
    ``GradientAccumulationPlugin``: in Accelerate it only advances a scheduler's internal ``_step_count`` (never its
    learning rate), and Lightning has no counterpart, so it has no effect here.

    How it drives Lightning: the automatic-optimization loop decides three things per batch from
    ``trainer.accumulate_grad_batches`` (k) and the epoch-local batch index: zero the gradients when
    ``batch_idx % k == 0``, divide the loss by k, and step when ``(batch_idx + 1) % k == 0`` or on the epoch's last
    batch. Windows that carry across epochs or end early do not fit that arithmetic, so for the trainer it runs on
    (and only during ``fit``) this callback plans each batch with :func:`plan_micro_batch` and answers each question
    itself: it sets k to the window's true size before the batch (the loss divisor), and replaces the training epoch
    loop's ``_should_accumulate`` and the optimization loop's ``_make_zero_grad_fn`` on those two loop objects. All
    three read Lightning's own batch counters, which Lightning restores on resume, so the callback keeps no state.

    Args:
        num_steps: Batches whose gradients are accumulated before each optimizer step (a positive integer).
        adjust_scheduler: Kept for parity with ``GradientAccumulationPlugin``; see above.
        sync_with_dataloader: Whether the last batch of each epoch closes the window (Accelerate's default).
        sync_each_batch: Whether gradients are synchronised across processes on every batch instead of only before a
            step.

    Raises:
        ValueError: If ``num_steps`` is not a positive integer.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[GradientAccumulation(num_steps=4)])  # doctest: +SKIP

    """

    def __init__(
        self,
        num_steps: int,
        *,
        adjust_scheduler: bool = True,
        sync_with_dataloader: bool = True,
        sync_each_batch: bool = False,
    ) -> None:
        check_positive_int("GradientAccumulation(num_steps)", num_steps)
        check_bool("adjust_scheduler", adjust_scheduler)
        check_bool("sync_with_dataloader", sync_with_dataloader)
        check_bool("sync_each_batch", sync_each_batch)
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self._patches: list[InstancePatch] = []
        self._accumulate_before_fit: int | None = None
        self._warned_unknown_length = False

    @classmethod
    def from_plugin(cls, plugin: GradientAccumulationPlugin) -> GradientAccumulation:
        """Build the callback from Accelerate's ``GradientAccumulationPlugin``.

        Raises:
            TypeError: If ``plugin`` is not a ``GradientAccumulationPlugin``.
            ValueError: If ``plugin.num_steps`` is ``None`` (Accelerate then takes the Accelerator's argument; a
                callback has none to take).

        """
        if not isinstance(plugin, GradientAccumulationPlugin):
            raise TypeError(f"Expected a GradientAccumulationPlugin, got {type(plugin).__name__}: {plugin!r}.")
        if plugin.num_steps is None:
            raise ValueError(
                "GradientAccumulationPlugin(num_steps=None) leaves the step count to the Accelerator; pass"
                " GradientAccumulationPlugin(num_steps=N) to build a GradientAccumulation callback."
            )
        return cls(
            plugin.num_steps,
            adjust_scheduler=plugin.adjust_scheduler,
            sync_with_dataloader=plugin.sync_with_dataloader,
            sync_each_batch=plugin.sync_each_batch,
        )

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(num_steps=self.num_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_compatible(trainer, pl_module)
        self._accumulate_before_fit = trainer.accumulate_grad_batches
        # Read by engines that accumulate themselves (DeepSpeed's gradient_accumulation_steps) in strategy.setup.
        trainer.accumulate_grad_batches = self.num_steps
        if trainer.strategy.handles_gradient_accumulation:
            self._hand_over_to_engine(trainer)
            return
        self._install(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._patches:
            return
        if trainer.num_training_batches == math.inf and not self._warned_unknown_length:
            self._warn_unknown_length_once()
        trainer.accumulate_grad_batches = self._plan(trainer).window_size

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._patches:
            trainer.accumulate_grad_batches = self.num_steps

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._uninstall(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks when fit raises.
        self._uninstall(trainer)

    def _uninstall(self, trainer: pl.Trainer) -> None:
        while self._patches:
            self._patches.pop().restore()
        if self._accumulate_before_fit is not None:
            trainer.accumulate_grad_batches = self._accumulate_before_fit
            self._accumulate_before_fit = None

    def _plan(self, trainer: pl.Trainer) -> MicroBatch:
        """The plan for the batch Lightning is processing (the last one made ready)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        length = trainer.num_training_batches
        return plan_micro_batch(
            self.num_steps,
            sync_with_dataloader=self.sync_with_dataloader,
            batch_idx=progress.current.ready - 1,
            total_batch_idx=progress.total.ready - 1,
            epoch_length=None if length == math.inf else int(length),
            is_last_batch=progress.is_last_batch,
        )

    def _install(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        optimization = epoch_loop.automatic_optimization
        make_zero_grad_fn = get_make_zero_grad_fn(optimization)

        def should_accumulate() -> bool:
            if epoch_loop.batch_progress.current.ready == 0:
                return False
            return not self._plan(trainer).steps

        def zero_grad_fn_at_window_start(batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
            if not self._plan(trainer).starts_window:
                return None
            # Lightning builds its zero_grad closure only when batch_idx % k == 0; k=1 makes that true.
            with _accumulate_grad_batches(trainer, 1):
                return make_zero_grad_fn(batch_idx, optimizer)

        self._patches.append(InstancePatch(epoch_loop, "_should_accumulate", should_accumulate))
        self._patches.append(InstancePatch(optimization, "_make_zero_grad_fn", zero_grad_fn_at_window_start))
        if self.sync_each_batch and not _blocking_marks_step_boundary(trainer.strategy):
            self._patches.append(InstancePatch(trainer.strategy, "block_backward_sync", contextlib.nullcontext))

    def _hand_over_to_engine(self, trainer: pl.Trainer) -> None:
        strategy = type(trainer.strategy).__name__
        message = (
            f"{strategy} accumulates gradients itself: GradientAccumulation set its step count to {self.num_steps}"
            " (trainer.accumulate_grad_batches); its engine decides windows and loss scaling."
        )
        if self.sync_each_batch or not self.sync_with_dataloader:
            rank_zero_warn(
                f"{message} GradientAccumulation(sync_each_batch={self.sync_each_batch},"
                f" sync_with_dataloader={self.sync_with_dataloader}) does not apply under {strategy}; use the"
                " defaults to silence this warning."
            )
        else:
            rank_zero_info(message)

    def _warn_unknown_length_once(self) -> None:
        self._warned_unknown_length = True
        rank_zero_warn(
            "GradientAccumulation: the training dataloader has no length, so the size of an epoch's last window is"
            f" unknown until its last batch; that window's loss is divided by num_steps={self.num_steps} (as in"
            " Accelerate) rather than by its true size. Give the dataset a __len__ for exact scaling."
        )


def _check_compatible(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    callbacks = getattr(trainer, "callbacks", ())
    if sum(isinstance(cb, GradientAccumulation) for cb in callbacks) > 1:
        raise ValueError("The Trainer has more than one GradientAccumulation callback; keep one.")
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and the GradientAccumulation"
            " callback both set gradient accumulation; remove `accumulate_grad_batches` from the Trainer."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks):
        raise ValueError(
            "GradientAccumulation and Lightning's GradientAccumulationScheduler both set gradient accumulation;"
            " keep only one of them."
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "GradientAccumulation drives Lightning's automatic optimization, but"
            f" {type(pl_module).__name__}.automatic_optimization is False; accumulate in training_step yourself"
            " (e.g. with `self.trainer.strategy.block_backward_sync()`) or remove the callback."
        )


def _blocking_marks_step_boundary(strategy: pl.strategies.Strategy) -> bool:
    """Whether ``strategy.block_backward_sync`` also tells its engine that the optimizer does not step yet.

    A DeepSpeed backward outside that context closes the accumulation window (ZeRO replaces the gradients it reduced
    since the last boundary), so ``sync_each_batch`` must not skip it there; elsewhere it only saves the all-reduce.
    """
    return bool(getattr(strategy, "marks_step_boundary", False))


@contextlib.contextmanager
def _accumulate_grad_batches(trainer: pl.Trainer, value: int) -> Iterator[None]:
    previous = trainer.accumulate_grad_batches
    trainer.accumulate_grad_batches = value
    try:
        yield
    finally:
        trainer.accumulate_grad_batches = previous
