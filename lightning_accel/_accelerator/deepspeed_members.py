"""What ``Accelerator.prepare`` returns for a model under DeepSpeed (or a pipeline), and DeepSpeed-only members.

HF accelerate's ``prepare`` returns the ``deepspeed.DeepSpeedEngine`` itself, and programs rely on it:
``transformers.Trainer`` saves and resumes through ``engine.save_checkpoint`` / ``load_checkpoint``, reads
``engine.config`` and ``get_global_grad_norm()``. The ``Accelerator`` returns the engine too; Fabric's wrapper around it
stays inside the ``Accelerator`` (``_models``), which is what ``backward``, ``save_state`` and the others run through,
and :meth:`ReturnedModels.wrapper_of` finds it again from the engine a caller passes back.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.wrappers import _FabricModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module

from lightning_accel._accelerator.megatron import PipelineEngine
from lightning_accel._accelerator.module import AcceleratedModule
from lightning_accel._accelerator.prepared import PreparedObjects
from lightning_accel.config import ParallelismConfig
from lightning_accel.lightning_compat import fabric_forward_module, get_register_backward_hook
from lightning_accel.strategies.protocol import ShimStrategy
from lightning_accel.utils.deepspeed import DeepSpeedEngineWrapper

__all__ = ["ReturnedModels", "ulysses_loader"]


class ReturnedModels:
    """What ``prepare`` hands back for each model, and the way back from it to Fabric's wrapper.

    Args:
        strategy: The Fabric's strategy, which says what a prepared model is returned as (the DeepSpeed engine).
        prepared: The prepared objects, whose ``models`` are Fabric's wrappers.

    Attributes:
        engine_wrapped: The first returned DeepSpeed engine in Accelerate's ``DeepSpeedEngineWrapper`` (``None``
            without one): the ``Accelerator``'s ``deepspeed_engine_wrapped``.

    """

    def __init__(self, *, strategy: ShimStrategy, prepared: PreparedObjects) -> None:
        self._strategy = strategy
        self._prepared = prepared
        self.engine_wrapped: DeepSpeedEngineWrapper | None = None

    def returned(self, prepared: AcceleratedModule) -> Module:
        """What ``prepare`` returns for a model: an engine where the strategy runs one, else Fabric's wrapper.

        The DeepSpeed engine itself (as Accelerate), or a :class:`PipelineEngine` where the strategy runs a pipeline
        schedule (Megatron at ``pp_degree > 1``, as Accelerate's ``MegatronEngine``: its forward is the step).
        """
        pipeline = self._strategy.pipeline()
        if pipeline is not None:
            return PipelineEngine(prepared, pipeline, self._prepared)
        engine = self._strategy.returned_model(prepared)
        if engine is prepared:
            return prepared
        # The wrapper's refusal of a plain loss.backward() (the engine must run it) follows the engine's outputs.
        engine.register_forward_hook(lambda _module, _args, output: _guard_outputs(prepared, output))
        if self.engine_wrapped is None:  # Accelerate keeps the first engine for its backward
            self.engine_wrapped = DeepSpeedEngineWrapper(engine)
        return engine

    def wrapper_of(self, model: Module) -> Module:
        """Fabric's wrapper of a model ``prepare`` returned (the wrapper itself, or the engine it holds)."""
        if isinstance(model, _FabricModule):
            return model
        if isinstance(model, PipelineEngine):
            return model.module
        return next((m for m in self._prepared.models if fabric_forward_module(m) is model), model)

    def is_prepared(self, model: Module) -> bool:
        """Whether ``prepare`` returned ``model`` already: Fabric's wrapper, or a DeepSpeed engine it handed back."""
        if isinstance(model, (_FabricModule, PipelineEngine)):
            return True
        return any(self._strategy.returned_model(m) is model for m in self._prepared.models)


def ulysses_loader(dl: Any, parallelism_config: ParallelismConfig | None) -> Any:
    """``deepspeed_ulysses_dl_adapter``: ``dl`` itself, as Accelerate returns it with a sequence-parallel size of 1.

    Raises:
        NotImplementedError: With a ``parallelism_config`` whose ``sp_size`` is above 1.

    """
    sp_size = getattr(parallelism_config, "sp_size", 1) if parallelism_config is not None else 1
    if sp_size == 1:
        return dl
    raise NotImplementedError(
        f"DeepSpeed Ulysses sequence parallelism (sp_size={sp_size}) is not supported by lightning_accel; use"
        " ParallelismConfig(sp_size=1) or HF accelerate for it."
    )


def _guard_outputs(prepared: AcceleratedModule, output: Any) -> None:
    apply_to_collection(output, Tensor, get_register_backward_hook(prepared))
