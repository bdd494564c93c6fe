"""What ``Accelerator.prepare`` returns for a pipeline-parallel Megatron model: an engine whose forward is the step.

As Accelerate's ``MegatronEngine``, calling the prepared model in training mode runs the whole training step: the
optimizers' gradients cleared, the batch's forward and backward passes through the strategy's pipeline schedule
(megatron-core's 1F1B over ``num_micro_batches`` micro-batches), the optimizer step (through Fabric, so the
strategy clips) and one step of each prepared scheduler. It returns the loss on the last stage and ``0.0`` on the
others. In evaluation mode (``model.eval()``) it runs the forward passes only. ``accelerator.backward``, the
prepared optimizers' ``step`` / ``zero_grad`` and the prepared schedulers' ``step`` then do nothing, as in
Accelerate. The pipeline itself is the strategy's (:meth:`ShimStrategy.pipeline`); this module only adapts
Accelerate's calling convention to it.

The model's inputs and loss follow Accelerate's GPT train step for a megatron-core ``GPTModel``
(:class:`GPTTrainStep`): the batch holds ``input_ids`` and ``labels`` (optionally a ``loss_mask``); a script with
another model sets the engine's ``train_step`` to an object with its own ``forward`` and ``loss``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel.strategies.protocol import PipelineStep

__all__ = ["GPTTrainStep", "MegatronTrainStep", "PipelineEngine", "pipeline_batch"]

_KEYS = ("input_ids", "labels", "loss_mask")


class MegatronTrainStep(Protocol):
    """How the engine feeds one micro-batch to a stage and turns the last stage's output into the loss."""

    def forward(self, module: Module, micro_batch: Sequence[Tensor]) -> Tensor:
        """The stage's output for ``micro_batch`` (hidden states, or the per-token loss on the last stage)."""

    def loss(self, output: Tensor, micro_batch: Sequence[Tensor]) -> Tensor:
        """The scalar loss of ``micro_batch`` from the last stage's ``output``."""


class GPTTrainStep:
    """Accelerate's GPT train step for a megatron-core ``GPTModel`` (``gpt_model``), on ``[ids, labels(, mask)]``.

    The model gets the positions ``0..seq-1`` and a causal mask; the loss is the per-token loss averaged over the
    tokens the loss mask keeps (all of them without one), as Accelerate's GPT loss function computes it.
    """

    def forward(self, module: Module, micro_batch: Sequence[Tensor]) -> Tensor:
        """``module(input_ids, position_ids, causal_mask, labels=labels)``."""
        ids, labels = micro_batch[0], micro_batch[1]
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        causal = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).triu(1)
        return module(ids, positions, causal, labels=labels)

    def loss(self, output: Tensor, micro_batch: Sequence[Tensor]) -> Tensor:
        """The mean per-token loss over the tokens the loss mask keeps."""
        losses = output.float()
        if len(micro_batch) < 3:
            return losses.mean()
        mask = micro_batch[2].reshape(-1).float()
        return (losses.reshape(-1) * mask).sum() / mask.sum()


def pipeline_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Tensor]:
    """The engine's call arguments as ``[input_ids, labels(, loss_mask)]``.

    Accepted: ``model(**batch)`` or ``model(batch)`` with a mapping holding ``input_ids`` and ``labels`` (and
    ``loss_mask``), or the tensors in that order (``model(ids, labels)``, ``model(batch)`` with a list or tuple).

    Raises:
        TypeError: For other arguments, naming what was given.

    """
    if not kwargs and len(args) == 1 and isinstance(args[0], Mapping):
        kwargs, args = args[0], ()
    elif not kwargs and len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = tuple(args[0])
    if kwargs and not args and {"input_ids", "labels"} <= kwargs.keys():
        return [kwargs[key] for key in _KEYS if key in kwargs]
    if args and not kwargs and all(isinstance(arg, Tensor) for arg in args) and 2 <= len(args) <= 3:
        return list(args)
    given = [type(arg).__name__ for arg in args] + sorted(kwargs)
    raise TypeError(
        "A pipeline-parallel Megatron model prepared by the Accelerator is called with one batch: input_ids and "
        f"labels (and an optional loss_mask), as keywords, a mapping or tensors in that order; got {given}. Set "
        "model.train_step to an object with forward(module, micro_batch) and loss(output, micro_batch) for another "
        "model's inputs."
    )


class PipelineEngine(Module):
    """The prepared model at ``pp_degree > 1``: calling it runs a training step (or, in ``eval()``, evaluates).

    Args:
        wrapper: Fabric's wrapper of this pipeline stage (what ``prepare`` returns for other strategies).
        pipeline: The strategy's pipeline schedule.
        prepared: The ``Accelerator``'s prepared objects: the optimizers and schedulers the step advances.

    Attributes:
        module: Fabric's wrapper of the stage.
        train_step: How micro-batches reach the stage and become the loss (:class:`GPTTrainStep` by default).

    """

    def __init__(self, wrapper: Module, pipeline: PipelineStep, prepared: PreparedObjects) -> None:
        super().__init__()
        self.module = wrapper
        self._pipeline = pipeline
        self._prepared = prepared
        self.train_step: MegatronTrainStep = GPTTrainStep()

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step on the batch (training mode) or its evaluation (``eval()``); the reported loss."""
        batch = pipeline_batch(args, kwargs)
        step = self.train_step
        if not self.module.training:
            return self._pipeline.pipeline_step(self.module, batch, step.forward, step.loss, forward_only=True)
        optimizers = [prepared.optimizer for prepared in self._prepared.optimizers]  # Fabric's: the strategy steps
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = self._pipeline.pipeline_step(self.module, batch, step.forward, step.loss)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in self._prepared.schedulers:
            scheduler.scheduler.step()
        return loss
