"""Pipeline-parallel training steps of ``acc_megatron_lm`` through megatron-core's own schedules.

:func:`pipeline_step` splits a batch into ``MegatronLMPlugin.num_micro_batches`` micro-batches and runs the schedule
``megatron.core.pipeline_parallel.get_forward_backward_func()`` picks for the parallel state (1F1B across pipeline
stages, or no pipelining at ``pp_degree=1``): forward and backward of every micro-batch, activations and their
gradients sent between stages by megatron's p2p communicator. It reports the loss as Accelerate's megatron
integration does: on the last stage, the mean over micro-batches of the loss averaged across data-parallel ranks;
``0.0`` on the other stages.

megatron-core 0.16.1's schedules allocate two things on CUDA whatever the model's device (the token counter,
``torch.zeros([], device="cuda")``, and the receive buffers, ``device=torch.cuda.current_device()``). On a CPU run
:func:`cpu_schedule_allocations` redirects exactly those allocations to the CPU for the duration of the schedule;
everything else (the schedule, the p2p exchange over gloo, the model) is megatron's own. megatron-core is imported
inside the functions only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

__all__ = ["Batch", "ForwardFn", "LossFn", "cpu_schedule_allocations", "pipeline_step", "split_micro_batches"]

Batch = Sequence[Tensor]
ForwardFn = Callable[[Module, Batch], Tensor]
LossFn = Callable[[Tensor, Batch], Tensor]


class _CudaAllocationsToCPU(TorchFunctionMode):
    """Turn a ``device="cuda"`` (or a CUDA index) argument of a torch call into the CPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextmanager
def cpu_schedule_allocations(device: torch.device) -> Iterator[None]:
    """On a CPU ``device``, let megatron's schedules allocate their buffers on the CPU (nothing changes on CUDA)."""
    with ExitStack() as stack:
        if device.type == "cpu":
            stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
            stack.enter_context(_CudaAllocationsToCPU())
        yield


def split_micro_batches(batch: Batch, count: int) -> list[list[Tensor]]:
    """``batch`` (tensors sharing their first dimension) cut into ``count`` equal micro-batches.

    Raises:
        ValueError: If the batch size is not a multiple of ``count``.

    """
    size = int(batch[0].shape[0])
    if size % count:
        raise ValueError(
            f"a batch of {size} samples cannot be cut into MegatronLMPlugin(num_micro_batches={count}) equal "
            f"micro-batches: use a batch size that is a multiple of {count}"
        )
    return [list(parts) for parts in zip(*(tensor.chunk(count) for tensor in batch), strict=True)]


def _data_parallel_mean(value: Tensor) -> Tensor:
    from megatron.core import parallel_state

    averaged = value.detach().clone().float()
    dist.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
    return averaged / parallel_state.get_data_parallel_world_size()


def _loss_func(loss_fn: LossFn, micro_batch: Batch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    loss = loss_fn(output, micro_batch)
    return loss, {"lm loss": _data_parallel_mean(loss)}


def _reported_loss(losses_reduced: list[dict[str, Tensor]], device: torch.device) -> Tensor:
    """Accelerate's report: the mean of each scalar entry over micro-batches, summed over entries (0 elsewhere)."""
    from megatron.core import parallel_state

    loss = torch.zeros((), device=device)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return loss
    for key in losses_reduced[0]:
        values = [entry[key] for entry in losses_reduced]
        if values[0].dim() == 0:
            loss = loss + sum(values) / len(values)
    return loss


def _all_reduce_gradients(module: Module) -> None:
    """Average the gradients over megatron's data-parallel group, unless DDP has (a pipeline stage is not wrapped)."""
    from megatron.core import parallel_state

    if isinstance(module, DistributedDataParallel):
        return
    group = parallel_state.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)


def pipeline_step(
    module: Module,
    batch: Batch,
    forward: ForwardFn,
    loss: LossFn,
    *,
    num_micro_batches: int,
    device: torch.device,
    forward_only: bool = False,
) -> Tensor:
    """Forward and backward ``batch`` through megatron's schedule; the gradients are left for the optimizer.

    Args:
        module: This stage's model (built with the stage's ``pre_process``/``post_process``).
        batch: Tensors ``[batch, sequence, ...]``; every stage passes the same batch, each uses what it needs.
        forward: ``forward(module, micro_batch)``: the model's output (hidden states, or the loss on the last stage).
        loss: ``loss(output, micro_batch)``: the micro-batch's scalar loss (called on the last stage only).
        num_micro_batches: How many micro-batches the batch is cut into.
        device: The device of the run (a CPU run redirects megatron's CUDA-only allocations).
        forward_only: Evaluate: the schedule's forward passes only, without gradients (megatron's
            ``forward_only=True`` under ``torch.no_grad()``).

    Returns:
        On the last stage, the mean loss over micro-batches (each averaged across data-parallel ranks); ``0.0``
        on the other stages, as Accelerate's ``MegatronEngine`` reports it.

    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = split_micro_batches(batch, num_micro_batches)
    pending = iter(micro_batches)

    def forward_step(data_iterator: Iterator[Batch], model: Module) -> tuple[Tensor, Any]:
        micro_batch = next(data_iterator)
        return forward(model, micro_batch), partial(_loss_func, loss, micro_batch)

    with cpu_schedule_allocations(device), torch.no_grad() if forward_only else nullcontext():
        losses_reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=pending,
            model=module,
            num_microbatches=num_micro_batches,
            seq_length=int(batch[0].shape[1]),
            micro_batch_size=int(micro_batches[0][0].shape[0]),
            forward_only=forward_only,
        )
    if not forward_only:
        _all_reduce_gradients(module)
    return _reported_loss(losses_reduced, device)
