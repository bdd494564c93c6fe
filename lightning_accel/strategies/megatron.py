"""``acc_megatron_lm``: Accelerate's ``DistributedType.MEGATRON_LM`` on megatron-core, for the Trainer and Fabric.

Both classes are this package's DDP strategies (one process per device, gloo on CPU and NCCL on CUDA) with
megatron-core's parallel state built over Lightning's process group; the behaviour lives once in
:class:`~lightning_accel.strategies.megatron_core.MegatronFamily`. Tensor parallelism comes from the model: build
megatron-core layers (or :func:`~lightning_accel.strategies.megatron_gpt.gpt_model`) inside ``configure_model`` for
the Trainer, or after ``fabric.launch()``. Data parallelism is ``DistributedDataParallel`` over megatron's
data-parallel group, and gradients are clipped by ``MegatronLMPlugin.gradient_clipping`` using the norm of the whole
(unsharded) gradient. Checkpoints hold whole tensors, whatever ``tp_degree`` wrote them
(:mod:`~lightning_accel.checkpoint.megatron`). Pipeline parallelism runs megatron's schedules through
``pipeline_step`` (one file per stage); sequence parallelism sums the layer-norm gradients across tensor-parallel
ranks before each step. Context and expert parallelism and megatron's distributed optimizer are refused with the
setting that asks for them (``RUN_FIELDS`` / ``REFUSED_FIELDS`` in :mod:`~lightning_accel.strategies.megatron_core`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_accel.checkpoint.engines import EngineCheckpoint
from lightning_accel.checkpoint.megatron import (
    MegatronStageCheckpoint,
    gather_model_state,
    gather_optimizer_state,
    split_model_state,
    split_optimizer_state,
    stage_checkpoint_path,
    writes_stage_checkpoint,
)
from lightning_accel.config import DistributedDataParallelKwargs, TorchDynamoPlugin
from lightning_accel.config.megatron import MegatronLMPlugin
from lightning_accel.enums import DistributedType, DynamoBackend
from lightning_accel.lightning_compat import fabric_forward_module
from lightning_accel.strategies.ddp import AcceleratedDDPStrategy, FabricAcceleratedDDPStrategy
from lightning_accel.strategies.ddp_core import ProcessGroupOptions
from lightning_accel.strategies.lightning_arguments import (
    FabricPlugins,
    ParallelArguments,
    TrainerPlugins,
)
from lightning_accel.strategies.megatron_core import MegatronFamily, clip_grad_norm_across_tensor_parallel
from lightning_accel.strategies.megatron_pipeline import Batch, ForwardFn, LossFn
from lightning_accel.strategies.protocol import PipelineStep
from lightning_accel.strategies.registry import StrategyEntry

__all__ = ["AcceleratedMegatronLMStrategy", "FabricAcceleratedMegatronLMStrategy"]


def _refuse_scaled_gradients(precision: Any, family: MegatronFamily) -> None:
    if family.plugin.gradient_clipping and getattr(precision, "scaler", None) is not None:
        raise ValueError(
            f"MegatronLMPlugin(gradient_clipping={family.plugin.gradient_clipping}) cannot clip fp16 gradients that "
            "are still loss-scaled; use precision='bf16-mixed' or '32-true', or pass gradient_clipping=0"
        )


class MegatronOptions(ProcessGroupOptions, total=False):
    """``acc_megatron_lm``'s settings besides ``megatron_lm_plugin`` (see :class:`AcceleratedMegatronLMStrategy`)."""

    ddp_kwargs: DistributedDataParallelKwargs | None
    dynamo_plugin: TorchDynamoPlugin | None


def _refuse_compilation(dynamo_plugin: TorchDynamoPlugin | None) -> None:
    """Accept a ``TorchDynamoPlugin`` that compiles nothing (``lightning-accel launch`` passes its backend ``NO``).

    Raises:
        ValueError: For a backend that would compile the megatron model.

    """
    if dynamo_plugin is not None and dynamo_plugin.backend != DynamoBackend.NO:
        raise ValueError(
            f"acc_megatron_lm does not compile models: got TorchDynamoPlugin(backend={dynamo_plugin.backend.value!r})"
            "; pass dynamo_backend='no' (or drop the config file's dynamo_config section)"
        )


class TrainerMegatronArgs(MegatronOptions, ParallelArguments, TrainerPlugins, total=False):
    """The keyword arguments of :class:`AcceleratedMegatronLMStrategy`."""


class FabricMegatronArgs(MegatronOptions, ParallelArguments, FabricPlugins, total=False):
    """The keyword arguments of :class:`FabricAcceleratedMegatronLMStrategy`."""


class _MegatronMembers:
    """What the Trainer and Fabric twins share, read from their ``_megatron`` family (listed first among the bases)."""

    _megatron: MegatronFamily

    def _adopt_megatron(self, plugin: MegatronLMPlugin | None, options: Mapping[str, Any]) -> dict[str, Any]:
        """Build the strategy's :class:`MegatronFamily`; the arguments for the DDP strategy it extends."""
        self._megatron = MegatronFamily(plugin, options.get("ddp_kwargs"))
        _refuse_compilation(options.get("dynamo_plugin"))
        return {"strategy_name": "acc_megatron_lm", **{k: v for k, v in options.items() if k != "dynamo_plugin"}}

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's type: ``MEGATRON_LM``."""
        return DistributedType.MEGATRON_LM

    @property
    def megatron_lm_plugin(self) -> MegatronLMPlugin:
        """The Megatron-LM settings this strategy runs."""
        return self._megatron.plugin

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over megatron's data-parallel group: tensor-parallel peers read the same batches."""
        return self._megatron.sampler_kwargs()

    def pipeline_step(
        self, module: Module, batch: Batch, forward: ForwardFn, loss: LossFn, *, forward_only: bool = False
    ) -> torch.Tensor:
        """Forward and backward one batch through megatron-core's pipeline schedule; then step the optimizer.

        The batch is cut into ``MegatronLMPlugin.num_micro_batches`` micro-batches and run by the schedule
        ``megatron.core.pipeline_parallel.get_forward_backward_func()`` chooses (1F1B across ``pp_degree`` stages).
        Every stage passes the same batch; ``forward(module, micro_batch)`` returns the model's output (the loss
        tensor on the last stage, hidden states elsewhere) and ``loss(output, micro_batch)`` the scalar loss. With
        ``forward_only`` (evaluation) the schedule runs the forward passes only, without gradients.

        Returns:
            On the last stage, the mean loss over micro-batches, averaged across data-parallel ranks; ``0.0`` on the
            other stages (as Accelerate's ``MegatronEngine`` reports it).

        """
        module = fabric_forward_module(module)  # the schedule calls backward itself, past Fabric's wrapper
        precision = self._megatron_precision()

        def forward_in_precision(stage: Module, micro_batch: Batch) -> torch.Tensor:
            with precision.forward_context():
                return forward(stage, micro_batch)

        device = self.root_device  # type: ignore[attr-defined]  # Lightning's, in the MRO
        return self._megatron.pipeline_step(
            module, batch, forward_in_precision, loss, device, forward_only=forward_only
        )

    def _megatron_precision(self) -> Any:
        """The precision plugin (``precision_plugin`` on the Trainer's strategy, ``precision`` on Fabric's)."""
        return getattr(self, "precision_plugin", None) or self.precision  # type: ignore[attr-defined]

    def _configure_launcher(self) -> None:
        """Megatron's device checks, then the DDP twin's."""
        self._megatron.check_devices(self.parallel_devices)  # type: ignore[attr-defined]  # Lightning's, in the MRO
        super()._configure_launcher()  # type: ignore[misc]  # the DDP twin's, after this class in the MRO

    def teardown(self) -> None:
        """Lightning's teardown, then megatron's parallel state is destroyed."""
        super().teardown()  # type: ignore[misc]  # the Lightning strategy after this class in the MRO
        self._megatron.teardown()


class AcceleratedMegatronLMStrategy(_MegatronMembers, AcceleratedDDPStrategy):
    """Trainer strategy for ``DistributedType.MEGATRON_LM``: megatron-core tensor parallelism plus data parallelism.

    Args:
        megatron_lm_plugin: The Megatron-LM settings; ``None`` is ``MegatronLMPlugin(context_parallel_size=1)``
            (tensor-parallel size 1).
        ddp_kwargs: Arguments for the data-parallel ``DistributedDataParallel``.
        init_kwargs: Process-group options (collective backend, init method, timeout).
        strategy_name: The name shown in messages (set by the registry).
        checkpoint_io: Lightning's checkpoint I/O; by default ``torch.save`` files, an unreadable one named in the
            error.
        **kwargs: The keyword settings above, and Lightning's ``accelerator``, ``parallel_devices``,
            ``cluster_environment`` and ``precision_plugin`` (the Trainer sets them when left out).

    Raises:
        ModuleNotFoundError: If megatron-core is not installed (the message names
            ``pip install lightning-accel[megatron]``).
        ValueError: For plugin settings this strategy does not implement (the message names the field and the fix).

    Example:
        >>> import lightning as L
        >>> from lightning_accel.utils import MegatronLMPlugin
        >>> plugin = MegatronLMPlugin(tp_degree=2, context_parallel_size=1)
        >>> strategy = AcceleratedMegatronLMStrategy(plugin)  # doctest: +SKIP
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP

    """

    def __init__(
        self, megatron_lm_plugin: MegatronLMPlugin | None = None, **kwargs: Unpack[TrainerMegatronArgs]
    ) -> None:
        super().__init__(**self._adopt_megatron(megatron_lm_plugin, kwargs))

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._megatron.setup_parallel_state(self.root_device)

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]  # a pipeline stage is not wrapped
        return self._megatron.wrap(model, self.determine_ddp_device_ids())

    @override
    def setup(self, trainer: Any) -> None:
        tp = self._megatron.plugin.tp_degree
        if tp > 1 and trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips by the norm of this rank's "
                f"tensor-parallel shard only (tp_degree={tp}); use MegatronLMPlugin(gradient_clipping=...), which "
                "clips by the norm of the whole gradient, or gradient_clip_algorithm='value'"
            )
        super().setup(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        _refuse_scaled_gradients(self.precision_plugin, self._megatron)
        target = model if isinstance(model, Module) else self.model
        assert target is not None

        def closure_then_clip() -> Any:
            result = closure()
            self._megatron.reduce_sequence_parallel_gradients([target])
            self._megatron.clip_gradients(target)
            return result

        return super().optimizer_step(optimizer, closure_then_clip, model, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint with whole tensor-parallel weights and optimizer state (every rank joins the gather)."""
        assert self.lightning_module is not None
        checkpoint = {**checkpoint, "state_dict": gather_model_state(checkpoint["state_dict"], self.lightning_module)}
        if "optimizer_states" in checkpoint:
            states = zip(checkpoint["optimizer_states"], self.optimizers, strict=True)
            checkpoint["optimizer_states"] = [gather_optimizer_state(state, opt) for state, opt in states]
        if self._megatron.plugin.pp_degree == 1:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        elif writes_stage_checkpoint():  # each stage's leader writes the stage's own file
            self.checkpoint_io.save_checkpoint(checkpoint, stage_checkpoint_path(filepath), storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint, at ``pp_degree > 1`` this pipeline stage's own file of it."""
        return super().load_checkpoint(stage_checkpoint_path(checkpoint_path), weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        state = split_model_state(checkpoint["state_dict"], self.lightning_module)
        super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = [
            split_optimizer_state(s, opt)
            for s, opt in zip(checkpoint["optimizer_states"], self.optimizers, strict=True)
        ]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})


class FabricAcceleratedMegatronLMStrategy(_MegatronMembers, FabricAcceleratedDDPStrategy):
    """Fabric twin of :class:`AcceleratedMegatronLMStrategy`.

    It takes the same arguments, with ``precision`` instead of ``precision_plugin``. Gradients are clipped by
    ``MegatronLMPlugin.gradient_clipping`` in ``optimizer.step()``, just before the update; ``fabric.save`` and
    ``fabric.load`` gather and slice tensor-parallel weights and optimizer state.
    """

    def __init__(
        self, megatron_lm_plugin: MegatronLMPlugin | None = None, **kwargs: Unpack[FabricMegatronArgs]
    ) -> None:
        super().__init__(**self._adopt_megatron(megatron_lm_plugin, kwargs))
        self._megatron_modules: list[Module] = []

    @override
    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._megatron.setup_parallel_state(self.root_device)

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]  # a pipeline stage is not wrapped
        wrapped = self._megatron.wrap(module, self._determine_ddp_device_ids())
        self._megatron_modules.append(wrapped)
        return wrapped

    def pipeline(self) -> PipelineStep | None:
        """The strategy itself at ``pp_degree > 1``: the ``Accelerator``'s prepared model runs :meth:`pipeline_step`.

        As in Accelerate's ``MegatronEngine``, the prepared model's forward is then the whole training step.
        """
        return self if self._megatron.plugin.pp_degree > 1 else None

    def checkpoint_engine(self) -> EngineCheckpoint | None:
        """``save_state``'s model and optimizer files with whole tensor-parallel tensors, one of each per stage.

        ``None`` at ``tp_degree = pp_degree = 1``, where every rank holds the whole model.
        """
        plugin = self._megatron.plugin
        return MegatronStageCheckpoint() if plugin.pp_degree > 1 or plugin.tp_degree > 1 else None

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """``fabric.clip_gradients(max_norm=...)`` by the norm of the whole gradient, across tensor-parallel shards.

        Raises:
            ValueError: For a norm other than L2, or with sequence parallelism (the layer-norm gradients are summed
                across tensor-parallel ranks in ``optimizer.step()``, after this call).
            RuntimeError: If ``error_if_nonfinite`` and the norm is not finite.

        """
        if float(norm_type) != 2.0:
            raise ValueError(f"acc_megatron_lm clips by the L2 norm only, got norm_type={norm_type}; pass 2")
        if self._megatron.plugin.sequence_parallelism:
            raise ValueError(
                "fabric.clip_gradients would clip before the sequence-parallel layer-norm gradients are summed "
                "(in optimizer.step()); with MegatronLMPlugin(sequence_parallelism=True) clip with "
                "MegatronLMPlugin(gradient_clipping=...) instead"
            )
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_across_tensor_parallel(params, float(max_norm), check_finite=error_if_nonfinite)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The module's state with whole tensor-parallel weights (every rank joins the gather in ``fabric.save``)."""
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        return gather_model_state(inner.state_dict(), inner)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state with whole tensor-parallel tensors (a collective, like the module's)."""
        return gather_optimizer_state(optimizer.state_dict(), optimizer)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: at ``pp_degree > 1`` the leader of each pipeline stage writes the stage's own file."""
        if self._megatron.plugin.pp_degree == 1:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        converted = {key: self._stage_state(key, value, filter or {}) for key, value in state.items()}
        if writes_stage_checkpoint():
            self.checkpoint_io.save_checkpoint(converted, stage_checkpoint_path(path), storage_options)

    def _stage_state(self, key: str, value: Any, filter: Mapping[str, Callable[[str, Any], bool]]) -> Any:
        """What ``fabric.save`` stores for ``state[key]``: a module's or optimizer's state dict, filtered."""
        if isinstance(value, Module):
            value = self.get_module_state_dict(value)
        elif isinstance(value, Optimizer):
            value = self.get_optimizer_state(value)
        elif callable(getattr(value, "state_dict", None)):
            value = value.state_dict()
        if key in filter and isinstance(value, dict):
            value = {name: item for name, item in value.items() if filter[key](name, item)}
        return value

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        super().load_module_state_dict(inner, split_model_state(state_dict, inner), strict=strict)

    @override
    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's loading (of this pipeline stage's own file), each optimizer given this rank's slices."""
        path = stage_checkpoint_path(path)
        if isinstance(state, Optimizer):
            state.load_state_dict(
                split_optimizer_state(super().load_checkpoint(path, weights_only=weights_only), state)
            )
            return {}
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        slicing = {name: _SlicingOptimizer(obj) if isinstance(obj, Optimizer) else obj for name, obj in state.items()}
        remainder = super().load_checkpoint(path, slicing, strict=strict, weights_only=weights_only)
        for name, value in slicing.items():  # plain values are restored into the dict given to Lightning
            if not isinstance(value, _SlicingOptimizer):
                state[name] = value
        return remainder

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        _refuse_scaled_gradients(self.precision, self._megatron)
        self._megatron.reduce_sequence_parallel_gradients(self._megatron_modules)
        for module in self._megatron_modules:
            self._megatron.clip_gradients(module)
        return super().optimizer_step(optimizer, **kwargs)


class _SlicingOptimizer:
    """Stands in for an optimizer while Lightning loads a checkpoint, so its whole tensors are sliced first."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(split_optimizer_state(state_dict, self.optimizer))


ENTRIES = (
    StrategyEntry(
        "acc_megatron_lm",
        AcceleratedMegatronLMStrategy,
        FabricAcceleratedMegatronLMStrategy,
        "Accelerate's MEGATRON_LM type: megatron-core tensor parallelism with data-parallel DDP (gloo on CPU)",
        DistributedType.MEGATRON_LM,
    ),
)
