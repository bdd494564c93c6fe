"""Accelerate's seedable shuffling for Lightning training dataloaders, sharded across processes and resumable."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler
from typing_extensions import override

from lightning_accel.callbacks._patching import InstancePatch
from lightning_accel.config import DataLoaderConfiguration
from lightning_accel.config._validation import check_non_negative_int, check_positive_int

__all__ = ["SeedableSampler", "ShardedSeedableSampler", "epoch_order", "shard_batches"]


def epoch_order(num_samples: int, data_seed: int, epoch: int) -> list[int]:
    """The order of one epoch: Accelerate's ``SeedableRandomSampler`` permutation for ``data_seed + epoch``."""
    generator = torch.Generator().manual_seed(data_seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def shard_batches(
    order: Sequence[int], batch_size: int, num_processes: int, process_index: int, drop_last: bool
) -> list[list[int]]:
    """The batches one process draws from ``order``, as Accelerate's ``BatchSamplerShard`` deals them.

    This is Accelerate's default sharding (``split_batches=False``, ``even_batches=True``): ``order`` is cut into
    global batches of ``batch_size`` and process ``p`` takes batches ``p, p + P, p + 2P, ...``. Without ``drop_last``
    the stream is padded with samples from its start until every process has the same number of full batches (the
    padding repeats samples, exactly as Accelerate does); with it, the last incomplete round is dropped. A single
    process is not sharded and keeps a short last batch unless ``drop_last``.

    Args:
        order: Dataset indices in epoch order.
        batch_size: Samples per batch on each process.
        num_processes: Number of data-parallel processes.
        process_index: This process's data-parallel rank.
        drop_last: Whether incomplete batches (rounds, with several processes) are dropped.

    Returns:
        The batches of ``process_index``, in order.

    """
    indices = list(order)
    if num_processes == 1:
        stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
        return [indices[i : min(i + batch_size, stop)] for i in range(0, stop, batch_size)]
    round_size = batch_size * num_processes
    if drop_last:
        indices = indices[: len(indices) - len(indices) % round_size]
    elif indices:
        head = indices[:round_size]
        padding = -len(indices) % round_size
        indices += [head[i % len(head)] for i in range(padding)]
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    return batches[process_index::num_processes]


def _samples_per_process(num_samples: int, batch_size: int, num_processes: int, drop_last: bool) -> int:
    if num_processes == 1:
        return num_samples - num_samples % batch_size if drop_last else num_samples
    rounds_rounding = math.floor if drop_last else math.ceil
    return int(rounds_rounding(num_samples / (batch_size * num_processes))) * batch_size


class ShardedSeedableSampler(Sampler[int]):
    """Indices of one process for one epoch: :func:`epoch_order` dealt by :func:`shard_batches`, flattened.

    The ``DataLoader`` regroups them into the same batches (it uses the same ``batch_size`` and ``drop_last``).

    Args:
        num_samples: Length of the dataset.
        batch_size: The ``DataLoader``'s batch size.
        drop_last: The ``DataLoader``'s ``drop_last``.
        num_processes: Number of data-parallel processes.
        process_index: This process's data-parallel rank.
        data_seed: Seed of epoch 0; epoch ``e`` uses ``data_seed + e``.
        epoch: The epoch the first iteration yields.
        skip_batches: Batches of ``epoch`` already consumed; the first iteration starts after them (mid-epoch
            resume). Later iterations start at the beginning.

    """

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        drop_last: bool,
        num_processes: int,
        process_index: int,
        data_seed: int,
        epoch: int = 0,
        skip_batches: int = 0,
    ) -> None:
        check_positive_int("batch_size", batch_size)
        check_positive_int("num_processes", num_processes)
        check_non_negative_int("skip_batches", skip_batches)
        if not 0 <= process_index < num_processes:
            raise ValueError(f"process_index must be in [0, {num_processes}), got {process_index}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.data_seed = data_seed
        self.epoch = epoch
        self._skip_batches = skip_batches
        # The DataLoader draws its workers' base seed from this generator at every iter(), not from the global RNG,
        # so creating an iterator never shifts the training RNG (which would break bit-exact resume).
        self.loader_generator = torch.Generator()
        self._seed_loader_generator()

    def __iter__(self) -> Iterator[int]:
        batches = shard_batches(
            epoch_order(self.num_samples, self.data_seed, self.epoch),
            self.batch_size,
            self.num_processes,
            self.process_index,
            self.drop_last,
        )
        skip, self._skip_batches = self._skip_batches, 0
        for batch in batches[skip:]:
            yield from batch

    def __len__(self) -> int:
        return _samples_per_process(self.num_samples, self.batch_size, self.num_processes, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields (Lightning calls this before each epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._skip_batches = 0
            self._seed_loader_generator()

    def _seed_loader_generator(self) -> None:
        self.loader_generator.manual_seed(self.data_seed + self.epoch)


class SeedableSampler(Callback):
    """Shuffle training data in Accelerate's seedable order, sharded across processes, from epoch 0 and on resume.

    Every shuffled training dataloader visits epoch ``e`` in the order of
    ``torch.randperm(n, generator=torch.Generator().manual_seed(data_seed + e))`` (Accelerate's
    ``SeedableRandomSampler``), dealt to processes like Accelerate's ``BatchSamplerShard`` with its defaults
    (``split_batches=False``, ``even_batches=True``; see :func:`shard_batches`). "Shuffled" means a ``RandomSampler``
    without replacement, or a ``DistributedSampler(shuffle=True)``, which Lightning injects for every training loader
    under a distributed strategy. Other loaders (custom samplers or batch samplers, iterable datasets) are left as
    they are, with a warning. The number of processes and this process's rank come from the strategy's
    ``distributed_sampler_kwargs``, so data-parallel groups of model-parallel strategies shard correctly.

    How it gets in from epoch 0: callbacks run too late to swap a sampler (the fit loop creates the first iterator
    before ``on_train_start``), but every dataloader passes through ``trainer.strategy.process_dataloader`` after
    Lightning injected its sampler and before any iterator exists. During ``fit``, this callback wraps that method
    on the trainer's strategy object (not its class) and rebuilds each training loader around a
    :class:`ShardedSeedableSampler` with Lightning's own ``_update_dataloader``, the function Lightning uses to
    inject ``DistributedSampler``. Lightning then calls the sampler's ``set_epoch`` before each epoch.

    Resume: the callback's state (the seed, the epoch and how many batches of it were consumed) is saved in each
    checkpoint, and the rebuilt loader of a resumed run starts right after the last consumed batch. Lightning's own
    fit loop creates that first iterator before it calls ``set_epoch``, which is why the position is handed to the
    sampler when it is built. The loader's worker seeds derive from ``data_seed + epoch`` too, and building an
    iterator no longer draws from the global torch RNG.

    Args:
        data_seed: Seed of epoch 0. ``None`` takes ``torch.initial_seed()`` of the global-rank-0 process at setup
            (Accelerate takes each process's own, which would give processes different orders).

    Raises:
        ValueError: If ``data_seed`` is negative.

    """

    def __init__(self, data_seed: int | None = None) -> None:
        check_non_negative_int("SeedableSampler(data_seed)", data_seed, optional=True)
        self.data_seed = data_seed
        self._seed: int | None = data_seed
        self._epoch = 0
        self._batches_seen = 0
        self._epoch_done = False
        self._resume_from: tuple[int, int] | None = None
        self._patch: InstancePatch | None = None

    @classmethod
    def from_config(cls, config: DataLoaderConfiguration) -> SeedableSampler:
        """Build the callback from Accelerate's ``DataLoaderConfiguration`` (its ``data_seed``).

        Raises:
            ValueError: If the configuration asks for sharding this callback does not do (``split_batches=True`` or
                ``even_batches=False``) or does not enable ``use_seedable_sampler``.

        """
        if not isinstance(config, DataLoaderConfiguration):
            raise TypeError(f"Expected a DataLoaderConfiguration, got {type(config).__name__}: {config!r}.")
        if not config.use_seedable_sampler:
            raise ValueError(
                "DataLoaderConfiguration(use_seedable_sampler=False) asks for no seedable sampler; set it to True"
                " or do not add the SeedableSampler callback."
            )
        if config.split_batches or not config.even_batches:
            raise ValueError(
                f"SeedableSampler shards like Accelerate's defaults (split_batches=False, even_batches=True), got"
                f" split_batches={config.split_batches}, even_batches={config.even_batches}. Lightning feeds every"
                " process full batches of equal count; set both to their defaults."
            )
        return cls(data_seed=config.data_seed)

    @property
    def seed(self) -> int | None:
        """The seed in use: ``data_seed``, or the one resolved at setup or restored from a checkpoint."""
        return self._seed

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if sum(isinstance(cb, SeedableSampler) for cb in getattr(trainer, "callbacks", ())) > 1:
            raise ValueError("The Trainer has more than one SeedableSampler callback; keep one.")
        if self._seed is None:
            self._seed = int(trainer.strategy.broadcast(torch.initial_seed() % 2**63, src=0))
        original = trainer.strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            return self._reseat(trainer, dataloader) if trainer.training else dataloader

        self._patch = InstancePatch(trainer.strategy, "process_dataloader", process_dataloader)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every training loader of this fit has been rebuilt by now; later rebuilds start at an epoch boundary.
        self._resume_from = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = trainer.current_epoch
        self._batches_seen = 0
        self._epoch_done = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batches_seen += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._epoch_done = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._uninstall()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks when fit raises.
        self._uninstall()

    def _uninstall(self) -> None:
        if self._patch is not None:
            self._patch.restore()
            self._patch = None

    @override
    def state_dict(self) -> dict[str, Any]:
        """Seed, epoch and batches consumed; an epoch whose last batch ran is saved as the next epoch's start."""
        epoch, seen = (self._epoch + 1, 0) if self._epoch_done else (self._epoch, self._batches_seen)
        return {"data_seed": self._seed, "epoch": epoch, "batches_seen": seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_seed = state_dict["data_seed"]
        if self.data_seed is not None and saved_seed != self.data_seed:
            raise ValueError(
                f"The checkpoint was written with SeedableSampler(data_seed={saved_seed}) but this run uses"
                f" data_seed={self.data_seed}; resume with the same seed (or data_seed=None to adopt the saved one)."
            )
        self._seed = saved_seed
        self._epoch = state_dict["epoch"]
        self._batches_seen = state_dict["batches_seen"]
        self._epoch_done = False
        self._resume_from = (self._epoch, self._batches_seen)

    def _reseat(self, trainer: pl.Trainer, dataloader: object) -> object:
        reason = _why_not_reseatable(dataloader)
        if reason is not None:
            rank_zero_warn(f"SeedableSampler left a training dataloader as it is: {reason}.")
            return dataloader
        assert isinstance(dataloader, DataLoader) and dataloader.batch_size is not None
        assert self._seed is not None
        epoch, seen = self._resume_from or (trainer.current_epoch, 0)
        shard = trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        num_samples = len(dataloader.dataset)  # type: ignore[arg-type]
        batch_size, drop_last = dataloader.batch_size, dataloader.drop_last
        samples = _samples_per_process(num_samples, batch_size, shard["num_replicas"], drop_last)
        # A shorter loader cycled by a CombinedLoader has gone round `seen // batches` times already.
        batches = math.ceil(samples / batch_size)
        sampler = ShardedSeedableSampler(
            num_samples,
            batch_size=batch_size,
            drop_last=drop_last,
            num_processes=shard["num_replicas"],
            process_index=shard["rank"],
            data_seed=self._seed,
            epoch=epoch,
            skip_batches=seen % batches if batches else 0,
        )
        reseated = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
        reseated.generator = sampler.loader_generator
        return reseated


def _why_not_reseatable(dataloader: object) -> str | None:
    if not isinstance(dataloader, DataLoader):
        return f"{type(dataloader).__name__} is not a torch DataLoader"
    if not hasattr(dataloader.dataset, "__len__"):
        return "its dataset has no length (iterable-style datasets are not shuffled by a sampler)"
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        return f"it uses a custom batch sampler ({type(dataloader.batch_sampler).__name__})"
    sampler = dataloader.sampler
    if type(sampler) is DistributedSampler:
        return None if sampler.shuffle else "its DistributedSampler does not shuffle"
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(dataloader.dataset):
            return "its RandomSampler draws with replacement or a custom num_samples"
        return None
    return f"its sampler ({type(sampler).__name__}) does not shuffle, or shuffles in its own way"
