"""The ``Accelerator``'s data-loader methods, its ``dataloader_config`` properties and ``join_uneven_inputs``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from lightning.fabric import Fabric
from torch.distributed.algorithms import Join, Joinable
from torch.utils.data import DataLoader

from lightning_accel._shim.parallelism import data_shards
from lightning_accel.config import DataLoaderConfiguration
from lightning_accel.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from lightning_accel.data_loader import skip_first_batches as _skip_first_batches
from lightning_accel.data_loader.sharding import BatchSamplerShard
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.state import AcceleratorState, PartialState
from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["DataLoaderControl"]

# The types whose processes join: Accelerate's multi-device DDP types, and multi-CPU (Accelerate does not join there).
_DATA_PARALLEL = frozenset(
    {
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_NEURON,
    }
)


class DataLoaderControl:
    """Accelerate's data-loader methods and ``dataloader_config`` properties, for the ``Accelerator``."""

    dataloader_config: DataLoaderConfiguration
    device_placement: bool
    rng_types: list[str]
    fabric: Fabric
    _strategy: ShimStrategy
    state: AcceleratorState
    _dataloaders: list[DataLoaderShard]

    @property
    def split_batches(self) -> bool:
        """``dataloader_config.split_batches``: each batch is split between the processes."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """``dataloader_config.dispatch_batches``: process 0 reads the batches and sends them out."""
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """``dataloader_config.even_batches``: the last round is padded so every process gets as many batches."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """Change ``even_batches`` for the loaders prepared from now on."""
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """``dataloader_config.use_seedable_sampler``."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """``dataloader_config.non_blocking``: batches are copied to the device asynchronously."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """``dataloader_config.use_stateful_dataloader``: loaders are torchdata ``StatefulDataLoader`` s."""
        return self.dataloader_config.use_stateful_dataloader

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable[..., Any] | None = None,
    ) -> DataLoaderShard:
        """Shard ``data_loader`` for this process as :attr:`dataloader_config` says.

        See :func:`lightning_accel.data_loader.prepare_data_loader`; ``slice_fn_for_dispatch`` slices dispatched
        batches (``dispatch_batches``). A loader prepared already is returned as it is.
        """
        if isinstance(data_loader, DataLoaderShard):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        config = self.dataloader_config
        state = PartialState()
        place = self.device_placement if device_placement is None else device_placement
        num_processes, process_index = data_shards(self._strategy)  # the data-parallel group (mesh's dp)
        prepared = prepare_data_loader(
            data_loader,
            state.device if place else None,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=config.split_batches,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            rng_types=list(self.rng_types),
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
        )
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        """A copy of a prepared loader that skips its first ``num_batches`` batches."""
        return _skip_first_batches(dataloader, num_batches)

    @contextmanager
    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Generator[None, None, None]:
        """Let processes with fewer batches drop out of gradient synchronisation instead of hanging (DDP only).

        Inside the block, torch's ``Join`` shadows the collectives of processes that ran out of batches. It is on
        when the loaders are uneven (``even_batches=False``); ``even_batches`` overrides the setting of the map-style
        loaders prepared so far for the duration of the block.

        Args:
            joinables: Prepared models (and other ``torch.distributed.algorithms.Joinable`` objects).
            even_batches: Temporarily pad (``True``) or not (``False``) the prepared map-style loaders.

        Raises:
            TypeError: If an object cannot join (e.g. a plain optimizer), naming it.

        """
        distributed_type = self.state.distributed_type
        if distributed_type not in _DATA_PARALLEL or not self._strategy.joins_uneven_inputs:
            if distributed_type != DistributedType.NO:
                warnings.warn(
                    "Joining uneven inputs is only supported for multi-GPU (and, here, multi-CPU) DDP training; under"
                    f" {distributed_type} join_uneven_inputs has no effect.",
                    stacklevel=3,
                )
            yield
            return
        members = [_joinable(obj) for obj in joinables]
        with ExitStack() as stack:
            if even_batches is not None:
                for sampler in self._batch_sampler_shards():
                    stack.callback(setattr, sampler, "even_batches", sampler.even_batches)
                    sampler.even_batches = even_batches
            uneven = not (self.even_batches if even_batches is None else even_batches)
            stack.enter_context(Join(members, enable=uneven, throw_on_early_termination=False))
            yield

    def _batch_sampler_shards(self) -> list[BatchSamplerShard]:
        shards: list[BatchSamplerShard] = []
        for loader in self._dataloaders:
            if isinstance(loader, DataLoaderDispatcher):
                warnings.warn(
                    "Overriding even_batches in join_uneven_inputs is only supported for map-style datasets: a"
                    " dispatched (iterable) loader keeps its setting.",
                    stacklevel=4,
                )
                continue
            shards += [s for s in (loader.batch_sampler, loader.sampler) if isinstance(s, BatchSamplerShard)]
        return shards


def _joinable(obj: Any) -> Joinable:
    inner = fabric_forward_module(obj)
    if not isinstance(inner, Joinable):
        raise TypeError(
            f"join_uneven_inputs joins prepared DDP models (torch Joinable objects), got {type(obj).__name__}."
        )
    return inner
