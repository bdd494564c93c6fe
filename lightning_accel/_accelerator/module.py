"""The module an ``Accelerator`` returns from ``prepare``: Fabric's wrapper, with ``loss.backward()`` allowed.

Fabric puts a hook on every forward output that refuses ``loss.backward()`` whenever the strategy or the precision
plugin overrides any backward method, which all of this package's plugins do. Accelerate scripts often call
``loss.backward()`` directly, and it is correct wherever nothing has to happen around the backward pass. So the hook
is kept only where something does: an engine that runs the backward itself (DeepSpeed) or fp16 loss scaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.strategies import Strategy
from lightning.fabric.wrappers import _FabricModule
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.overrides import is_overridden
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_accel.lightning_compat import (
    fabric_forward_module,
    get_in_fabric_backward,
    get_original_module,
    get_strategy,
    lightning_private_members,
)
from lightning_accel.precision.base import AcceleratePrecision

__all__ = [
    "AcceleratedModule",
    "backward_guard",
    "distributed_data_parallel",
    "evaluation_module",
    "plain_optimizer_step",
]


def distributed_data_parallel(model: Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper of a prepared ``model`` (or of a plain DDP module), if it has one."""
    inner = fabric_forward_module(model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def backward_guard(strategy: Strategy) -> str | None:
    """Why ``loss.backward()`` would be wrong under ``strategy`` and its precision plugin, or ``None`` if it is fine."""
    precision = strategy.precision
    if is_overridden("backward", strategy, parent=Strategy):
        return f"{type(strategy).__name__} runs the backward pass itself"
    if isinstance(precision, AcceleratePrecision):
        return "fp16 training scales the loss before backward" if precision.scaler is not None else None
    if any(is_overridden(name, precision, parent=Precision) for name in ("pre_backward", "backward", "post_backward")):
        return f"{type(precision).__name__} wraps the backward pass"
    return None


_FORWARD_HOOKS = ("convert_input", "forward_context", "autocast_context_manager", "convert_output")
_PASS_THROUGH_CLASSES: dict[type, bool] = {}


def _class_passes_forward_through(cls: type) -> bool:
    return issubclass(cls, AcceleratePrecision) and all(
        getattr(cls, name) is getattr(AcceleratePrecision, name) for name in _FORWARD_HOOKS
    )


def passes_forward_through(precision: Precision) -> bool:
    """Whether Fabric's forward steps are no-ops under ``precision``: fp32 autocast mode, none of the hooks changed.

    Its inputs and outputs are then left as they are and its forward context is ``nullcontext()``.
    """
    cls = type(precision)
    plain = _PASS_THROUGH_CLASSES.get(cls)
    if plain is None:
        plain = _PASS_THROUGH_CLASSES[cls] = _class_passes_forward_through(cls)
    return (
        plain
        and precision.mode == "mixed"  # type: ignore[attr-defined]  # an AcceleratePrecision, checked above
        and precision.compute_dtype == torch.float32  # type: ignore[attr-defined]
        and vars(precision).keys().isdisjoint(_FORWARD_HOOKS)
    )


def plain_optimizer_step(strategy: Strategy) -> bool:
    """Whether stepping through ``strategy`` and its precision plugin is just ``optimizer.step()``.

    True when neither overrides the step (no DeepSpeed engine, no XLA barrier) and there is no loss scaler.
    """
    precision = strategy.precision
    return (
        backward_guard(strategy) is None
        and not is_overridden("optimizer_step", strategy, parent=Strategy)
        and isinstance(precision, AcceleratePrecision)
        and not is_overridden("optimizer_step", precision, parent=AcceleratePrecision)
    )


@lightning_private_members("_register_backward_hook")
class AcceleratedModule(_FabricModule):
    """A ``_FabricModule`` whose outputs refuse ``loss.backward()`` only where it would give wrong gradients.

    It also answers for the strategy's wrapper (``model.no_sync()``, ``model.join()`` under DDP), which is what
    Accelerate's ``prepare`` returns.
    """

    # Why loss.backward() gives wrong gradients for this module (set in adopt); None: it gives right ones.
    _backward_guard: str | None = None
    # The strategy, where forward may call the wrapped module directly (see forward); None: Fabric's forward always.
    _direct_forward_strategy: Strategy | None = None
    # The precision plugin last found to pass the forward through (the check runs again for another plugin object).
    _plain_precision: Precision | None = None

    @classmethod
    def adopt(cls, module: _FabricModule) -> AcceleratedModule:
        """Turn a module Fabric has just set up into this class, in place."""
        # object.__setattr__: Fabric's __setattr__ would forward these names to the user's module as well.
        object.__setattr__(module, "__class__", cls)
        adopted: AcceleratedModule = module  # type: ignore[assignment]  # its class was just replaced
        strategy = get_strategy(adopted)
        guard = backward_guard(strategy)
        object.__setattr__(adopted, "_backward_guard", guard)
        if guard is None and adopted._modules.get("_forward_module") is fabric_forward_module(adopted):
            object.__setattr__(adopted, "_direct_forward_strategy", strategy)
        return adopted

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Fabric's forward; where its steps would do nothing, the wrapped module's call alone (it runs every step).

        Nothing to do means: no backward hook is needed (no backward guard), and the precision plugin converts
        nothing and enters ``nullcontext()`` (:func:`passes_forward_through`, asked once per plugin object: Fabric's
        plugins are configured when they are built).
        """
        strategy = self._direct_forward_strategy
        if strategy is None:
            return super().forward(*args, **kwargs)
        precision = strategy.precision
        if precision is not self._plain_precision:
            if not passes_forward_through(precision):
                return super().forward(*args, **kwargs)
            object.__setattr__(self, "_plain_precision", precision)
        forward_module: Module = self._modules["_forward_module"]  # type: ignore[assignment]  # checked in adopt
        output = forward_module(*args, **kwargs)
        if not isinstance(output, Tensor):  # Fabric's walk over the outputs, for its errors (a frozen dataclass)
            apply_to_collection(output, dtype=Tensor, function=self._register_backward_hook)
        return output

    @override
    def __getattr__(self, item: str) -> Any:
        """The user's module's attribute, else that of the strategy's wrapper (DDP's ``no_sync``, ``join``, ...).

        Accelerate's ``prepare`` returns the ``DistributedDataParallel`` module itself; this wrapper answers for it
        wherever the user's module has no attribute of that name.
        """
        try:
            return super().__getattr__(item)
        except AttributeError:
            if "_modules" not in self.__dict__ or item.startswith("__"):
                raise  # half-built (copying, unpickling) or a special name: nothing to forward to
            wrapper = fabric_forward_module(self)
            if wrapper is get_original_module(self) or not hasattr(wrapper, item):
                raise
            return getattr(wrapper, item)

    @override
    def _register_backward_hook(self, tensor: Tensor) -> Tensor:
        if self._backward_guard is not None and tensor.requires_grad:
            tensor.register_hook(self._refuse_plain_backward)
        return tensor

    def _refuse_plain_backward(self, *_: Any) -> None:
        from lightning.fabric import wrappers

        if not get_in_fabric_backward(wrappers):
            raise RuntimeError(
                f"Call `accelerator.backward(loss)` instead of `loss.backward()`: {self._backward_guard}."
            )


def evaluation_module(model: Module, strategy: Strategy, device: Any, dynamo_plugin: Any) -> AcceleratedModule:
    """``prepare_model(evaluation_mode=True)``: the precision plugin's forward and ``torch.compile``, no wrapper.

    As in Accelerate, a model prepared for evaluation only is not wrapped for distributed training (no DDP, no
    sharding); it is moved to ``device`` (unless ``None``) and compiled as ``dynamo_plugin`` says. Its train/eval
    mode is left as it is.
    """
    from lightning_accel.strategies.compile import apply_dynamo

    if device is not None:
        model = model.to(device)
    model = apply_dynamo(model, dynamo_plugin)
    return AcceleratedModule.adopt(_FabricModule(model, strategy, original_module=model))


def check_quantized_placement(model: Module, *, distributed: bool, cpu_kernels: bool, xpu: bool) -> None:
    """Refuse to prepare a bitsandbytes 8-bit/4-bit model whose device map cannot be trained, as Accelerate does.

    Args:
        model: The model; only one with ``is_loaded_in_8bit``/``is_loaded_in_4bit`` and an ``hf_device_map`` counts.
        distributed: Whether the run has several processes (or a sharding strategy).
        cpu_kernels: Whether bitsandbytes can run its layers on the CPU.
        xpu: Whether this machine trains on XPU (where CPU-offloaded layers cannot take part).

    Raises:
        ValueError: For a map over several devices in a distributed run, or layers offloaded to the CPU (without CPU
            kernels, or on XPU) or to disk.

    """
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not device_map:
        return
    devices = set(device_map.values())
    if len(devices) > 1 and distributed:
        raise ValueError(
            f"This 8-bit/4-bit model is mapped over {sorted(map(str, devices))}, which a distributed run cannot train:"
            " load it on one device per process (device_map={'': <the process's device>}) or run one process."
        )
    if ("cpu" in devices and (xpu or not cpu_kernels)) or "disk" in devices:
        raise ValueError(
            "A model loaded in 8-bit or 4-bit precision with CPU or disk offload cannot be trained: load it entirely"
            " on the training device (device_map={'': <device>}), or install a bitsandbytes with CPU kernels to"
            " train it on the CPU."
        )


def _wrapper_of(module: object, prepared: Sequence[AcceleratedModule]) -> AcceleratedModule | None:
    """The wrapper ``prepare`` returned for the plain module ``module``, or ``None`` if it was not prepared."""
    if not isinstance(module, Module) or isinstance(module, _FabricModule):
        return None
    return next((wrapper for wrapper in prepared if wrapper.module is module), None)


def reuse_prepared(objects: list[Any], prepared: Sequence[AcceleratedModule]) -> None:
    """Put in place of each plain module of ``objects`` that was prepared before the wrapper it got then.

    ``prepare(model)`` twice returns one wrapper (Accelerate returns the module it marked as prepared), so the model
    is set up, trained and saved once, not twice (``model.safetensors`` and ``model_1.safetensors``).
    """
    for index, obj in enumerate(objects):
        wrapper = _wrapper_of(obj, prepared)
        if wrapper is not None:
            objects[index] = wrapper


def prepared_models(models: Sequence[Module], prepared: Sequence[AcceleratedModule]) -> list[Module]:
    """``models`` with plain modules that were prepared replaced by their wrappers.

    Raises:
        TypeError: For a model ``prepare`` never saw, naming its class and the fix.

    """
    result: list[Module] = []
    for model in models:
        wrapper = model if isinstance(model, _FabricModule) else _wrapper_of(model, prepared)
        if wrapper is None:
            raise TypeError(
                f"accumulate() got a {type(model).__name__} that Accelerator.prepare has not set up, so its gradient "
                "synchronisation cannot be skipped between optimizer steps; pass the model `accelerator.prepare` "
                "returned (`model = accelerator.prepare(model)`)"
            )
        result.append(wrapper)
    return result


def check_backward_after_prepare(prepared: Sequence[AcceleratedModule]) -> None:
    """Refuse ``backward`` before any ``prepare``: precision, accumulation and sync would not apply to the loss.

    Raises:
        RuntimeError: Saying to prepare the model (and optimizer) first.

    """
    if not prepared:
        raise RuntimeError(
            "Accelerator.backward was called before any model was prepared, so mixed precision, gradient "
            "accumulation and gradient synchronisation would not apply; call `model, optimizer = "
            "accelerator.prepare(model, optimizer)` before the training loop"
        )


def autocast_own_forward(module: Module, precision: AcceleratePrecision) -> None:
    """Run ``module``'s own ``forward`` under the precision plugin's autocast when it is called outside Fabric's.

    Accelerate's ``prepare`` wraps the user's module's ``forward`` itself in autocast (and its outputs back to fp32),
    so the unwrapped model (``unwrap_model``, TRL's generation, a validation pipeline) computes in the mixed dtype
    too, and every call returns fp32 outputs. Here autocast is the precision plugin's, entered by Fabric's wrapper;
    this adds Accelerate's wrapper for the calls that do not go through Fabric's and converts the outputs of all.
    The original forward is recorded as ``_original_forward``: ``unwrap_model(keep_fp32_wrapper=False)`` restores it.
    A compiled module is left alone (its graph captured the forward it had).
    """
    if "_original_forward" in module.__dict__ or isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return
    original = module.forward
    module.__dict__["_original_forward"] = original
    module.forward = _AutocastForward(original, precision)


class _AutocastForward:
    """``forward`` under the precision plugin's autocast (unless it is on already), its outputs in fp32 as Accelerate's.

    A callable object rather than a closure, so that ``copy.deepcopy`` of the module rebinds it to the copy.
    """

    def __init__(self, original: Any, precision: AcceleratePrecision) -> None:
        from lightning_accel.utils.operations import ConvertOutputsToFp32

        self.__wrapped__ = original
        self._precision = precision
        self._device_type = precision.device_type
        self._in_fp32 = ConvertOutputsToFp32(original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled(self._device_type):  # inside the prepared model's forward
            return self._in_fp32(*args, **kwargs)
        with self._precision.forward_context():
            return self._in_fp32(*args, **kwargs)
