"""``LocalSGD``: train each process on its own for ``local_sgd_steps`` steps, then average the parameters.

Accelerate's helper, for data-parallel (DDP) runs: inside the ``with`` block the prepared model skips gradient
synchronisation (``Accelerator.no_sync``), so every process updates its replica from its own batches; every
``local_sgd_steps``-th :meth:`LocalSGD.step` (and the end of the block) averages the parameters over the processes.
With ``local_sgd_steps=1`` and SGD this is the same update as DDP's averaged gradients.

Example:
    >>> with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:  # doctest: +SKIP
    ...     for x, y in loader:
    ...         accelerator.backward(loss_fn(model(x), y))
    ...         optimizer.step()
    ...         optimizer.zero_grad()
    ...         local_sgd.step()

"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType

from torch.nn import Module
from typing_extensions import Self

from lightning_accel.accelerator import Accelerator
from lightning_accel.config.devices import BACKEND_BY_TYPE
from lightning_accel.enums import DistributedType
from lightning_accel.utils.operations import reduce

__all__ = ["LocalSGD"]


class LocalSGD:
    """Local SGD on top of an :class:`~lightning_accel.Accelerator` (data parallel on CPUs or accelerators).

    Args:
        accelerator: The accelerator that prepared ``model``.
        model: The prepared model whose parameters are averaged.
        local_sgd_steps: Optimizer steps between two averagings.
        enabled: ``False`` turns the helper off (gradients then synchronise as usual); it is off with one process.

    Raises:
        NotImplementedError: Under a strategy that does not replicate the model on every process (FSDP, DeepSpeed,
            N-D parallelism), as in Accelerate.
        ValueError: If ``local_sgd_steps`` is not a positive integer.

    """

    def __init__(self, accelerator: Accelerator, model: Module, local_sgd_steps: int, enabled: bool = True) -> None:
        dtype = accelerator.distributed_type
        if dtype != DistributedType.NO and dtype not in BACKEND_BY_TYPE:
            raise NotImplementedError(
                f"LocalSGD is supported only for data-parallel runs on CPUs and GPUs (MULTI_CPU, MULTI_GPU, ...), not"
                f" {dtype.value}: train without LocalSGD, or use a DDP launch."
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps must be a positive integer, got {local_sgd_steps!r}.")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and dtype != DistributedType.NO
        self.num_steps = 0
        self._no_sync: AbstractContextManager[None] | None = None

    def __enter__(self) -> Self:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled or self._no_sync is None:
            return
        if exc_type is None:
            self._average_parameters()  # the replicas leave the block equal
        self._no_sync.__exit__(exc_type, exc_value, traceback)
        self._no_sync = None

    def step(self) -> None:
        """Count an optimizer step; every ``local_sgd_steps``-th averages the parameters over the processes."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        self.accelerator.wait_for_everyone()
        for parameter in self.model.parameters():
            parameter.data = reduce(parameter.data, reduction="mean")
