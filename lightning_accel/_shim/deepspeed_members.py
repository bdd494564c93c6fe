"""What ``Accelerator.prepare`` returns for a model under DeepSpeed, and Accelerate's DeepSpeed-only members.

HF accelerate's ``prepare`` returns the ``deepspeed.DeepSpeedEngine`` itself, and programs rely on it:
``transformers.Trainer`` saves and resumes through ``engine.save_checkpoint`` / ``load_checkpoint``, reads
``engine.config`` and ``get_global_grad_norm()``. The ``Accelerator`` returns the engine too; Fabric's wrapper around it
stays inside the ``Accelerator`` (``_models``), which is what ``backward``, ``save_state`` and the others run through,
and :meth:`DeepSpeedMembers._prepared_wrapper` finds it again from the engine a caller passes back.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module

from lightning_accel._shim import engine_step as _engine_step
from lightning_accel._shim.module import AcceleratedModule
from lightning_accel.lightning_compat import fabric_forward_module, get_register_backward_hook
from lightning_accel.utils.deepspeed import DeepSpeedEngineWrapper

__all__ = ["DeepSpeedMembers"]


class DeepSpeedMembers:
    """``deepspeed_engine_wrapped``, ``deepspeed_ulysses_dl_adapter`` and the model ``prepare`` hands back."""

    fabric: Fabric
    _models: list[AcceleratedModule]
    parallelism_config: Any

    @property
    def deepspeed_engine_wrapped(self) -> DeepSpeedEngineWrapper | None:
        """The first prepared DeepSpeed engine in Accelerate's ``DeepSpeedEngineWrapper`` (``None`` without one)."""
        return self.__dict__.get("_deepspeed_engine_wrapped")

    @deepspeed_engine_wrapped.setter
    def deepspeed_engine_wrapped(self, value: DeepSpeedEngineWrapper | None) -> None:
        self.__dict__["_deepspeed_engine_wrapped"] = value

    def _returned_model(self, prepared: AcceleratedModule) -> Module:
        """What ``prepare`` returns for a model: the DeepSpeed engine itself (as Accelerate), else the wrapper."""
        if not _engine_step.engine_steps_in_backward(self.fabric.strategy):
            return prepared
        engine = fabric_forward_module(prepared)
        # The wrapper's refusal of a plain loss.backward() (the engine must run it) follows the engine's outputs.
        engine.register_forward_hook(lambda _module, _args, output: _guard_outputs(prepared, output))
        if self.deepspeed_engine_wrapped is None:  # Accelerate keeps the first engine for its backward
            self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
        return engine

    def _prepared_wrapper(self, model: Module) -> Module:
        """Fabric's wrapper of a model ``prepare`` returned (the wrapper itself, or the engine it holds)."""
        if isinstance(model, _FabricModule):
            return model
        return next((m for m in self._models if fabric_forward_module(m) is model), model)

    def _is_prepared_model(self, model: Module) -> bool:
        """Whether ``prepare`` returned ``model`` already: Fabric's wrapper, or a DeepSpeed engine it handed back."""
        if isinstance(model, _FabricModule):
            return True
        engines = _engine_step.engine_steps_in_backward(self.fabric.strategy)
        return engines and any(fabric_forward_module(m) is model for m in self._models)

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Module) -> Any:
        """Adapt a data loader prepared apart from the model to DeepSpeed's Ulysses sequence parallelism.

        With a sequence-parallel size of 1 (always, here: lightning_accel refuses ``sp_size`` > 1, see
        ``ParallelismConfig``) ``dl`` is returned as it is, as Accelerate does; ``transformers.Trainer`` calls it
        only when sequence parallelism is on.

        Raises:
            NotImplementedError: With a ``parallelism_config`` whose ``sp_size`` is above 1.

        """
        sp_size = getattr(self.parallelism_config, "sp_size", 1) if self.parallelism_config is not None else 1
        if sp_size == 1:
            return dl
        raise NotImplementedError(
            f"DeepSpeed Ulysses sequence parallelism (sp_size={sp_size}) is not supported by lightning_accel; use"
            " ParallelismConfig(sp_size=1) or HF accelerate for it."
        )


def _guard_outputs(prepared: AcceleratedModule, output: Any) -> None:
    apply_to_collection(output, Tensor, get_register_backward_hook(prepared))
