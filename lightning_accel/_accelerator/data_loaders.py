"""The ``Accelerator``'s data loaders: ``prepare_data_loader`` and ``join_uneven_inputs``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from torch.distributed.algorithms import Join, Joinable
from torch.utils.data import DataLoader

from lightning_accel._accelerator.parallelism import data_shards
from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel.config import DataLoaderConfiguration
from lightning_accel.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from lightning_accel.data_loader.sharding import BatchSamplerShard
from lightning_accel.enums import DistributedType
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.state import AcceleratorState, PartialState
from lightning_accel.strategies.protocol import ShimStrategy

__all__ = ["DataLoaders"]

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


class DataLoaders:
    """The ``Accelerator``'s data loaders: preparing them for this process's shard, skipping batches, joining.

    Args:
        config: How loaders are prepared (the ``Accelerator``'s ``dataloader_config``).
        strategy: The Fabric's strategy, which says which data-parallel shard this process reads and whether its
            processes can join uneven inputs.
        state: The shared process state (its distributed type and device).
        prepared: Where prepared loaders are recorded.

    """

    def __init__(
        self,
        *,
        config: DataLoaderConfiguration,
        strategy: ShimStrategy,
        state: AcceleratorState,
        prepared: PreparedObjects,
    ) -> None:
        self.config = config
        self._strategy = strategy
        self._state = state
        self._prepared = prepared

    def prepare(
        self,
        data_loader: DataLoader,
        *,
        device_placement: bool,
        rng_types: Sequence[str],
        slice_fn_for_dispatch: Callable[..., Any] | None,
    ) -> DataLoaderShard:
        """Shard ``data_loader`` for this process (see :meth:`lightning_accel.Accelerator.prepare_data_loader`)."""
        if isinstance(data_loader, DataLoaderShard):
            if data_loader not in self._prepared.dataloaders:
                self._prepared.dataloaders.append(data_loader)
            return data_loader
        config = self.config
        state = PartialState()
        place = device_placement
        num_processes, process_index = data_shards(self._strategy)  # the data-parallel group (mesh's dp)
        prepared = prepare_data_loader(
            data_loader,
            state.device if place else None,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=config.split_batches,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            rng_types=list(rng_types),
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
        )
        self._prepared.dataloaders.append(prepared)
        return prepared

    @contextmanager
    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Generator[None, None, None]:
        """Join uneven inputs inside the block (see ``Accelerator.join_uneven_inputs``)."""
        distributed_type = self._state.distributed_type
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
            uneven = not (self.config.even_batches if even_batches is None else even_batches)
            stack.enter_context(Join(members, enable=uneven, throw_on_early_termination=False))
            yield

    def _batch_sampler_shards(self) -> list[BatchSamplerShard]:
        shards: list[BatchSamplerShard] = []
        for loader in self._prepared.dataloaders:
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
