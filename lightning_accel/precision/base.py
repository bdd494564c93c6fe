"""The shared base of lightning_accel's precision plugins: one class that serves both the Trainer and Fabric.

Lightning's Trainer and Fabric call a precision plugin's hooks differently: the Trainer passes a LightningModule
attached to a trainer (and wants its callback hooks fired, the loss scaled in ``pre_backward`` and the step run through
a closure); Fabric passes plain modules, ignores what ``pre_backward`` returns and calls ``optimizer_step(optimizer)``.
:class:`AcceleratePrecision` accepts both call shapes, so each concrete plugin is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_accel.config import AutocastKwargs, GradScalerKwargs
from lightning_accel.lightning_compat import get_trainer, lightning_private_members
from lightning_accel.utils.modeling import default_device_type

Mode = Literal["mixed", "true"]


def _in_trainer(module: Module | None) -> bool:
    return isinstance(module, LightningModule) and get_trainer(module) is not None


@lightning_private_members("_after_closure")
class AcceleratePrecision(Precision):
    """Autocast (optionally with a gradient scaler) or whole-model casting to ``compute_dtype``.

    Args:
        compute_dtype: The dtype matmuls and convolutions run in.
        mode: ``"mixed"`` keeps fp32 weights and runs the forward under autocast; ``"true"`` casts the weights and
            floating-point inputs to ``compute_dtype`` (Lightning's ``"bf16-true"`` / ``"16-true"``).
        device: The device type autocast targets (``"cpu"``, ``"cuda"``, ...). ``None`` lets the strategy set it
            (every ``acc_*`` strategy does), else the current accelerator.
        autocast_kwargs: Accelerate's ``AutocastKwargs`` (``enabled``, ``cache_enabled``).
        scaler_kwargs: Accelerate's ``GradScalerKwargs``; ``None`` means no gradient scaling.
        scaler: A gradient scaler of the user's, used as it is (instead of one built from ``scaler_kwargs``).

    Raises:
        ValueError: For an unknown ``mode``, or a ``scaler`` together with ``scaler_kwargs`` or ``mode="true"``.
        TypeError: For arguments of the wrong type.

    """

    precision_type: str = "no"

    def __init__(
        self,
        compute_dtype: torch.dtype,
        mode: Mode = "mixed",
        device: str | None = None,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        _check_scaler(scaler, scaler_kwargs, mode)
        if mode not in ("mixed", "true"):
            raise ValueError(f"mode must be 'mixed' (autocast) or 'true' (cast the weights), got {mode!r}.")
        if autocast_kwargs is not None and not isinstance(autocast_kwargs, AutocastKwargs):
            raise TypeError(f"`autocast_kwargs` must be an AutocastKwargs, got {type(autocast_kwargs).__name__}.")
        if scaler_kwargs is not None and not isinstance(scaler_kwargs, GradScalerKwargs):
            raise TypeError(f"`scaler_kwargs` must be a GradScalerKwargs, got {type(scaler_kwargs).__name__}.")
        self.compute_dtype = compute_dtype
        self.mode: Mode = mode
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self._scaler_kwargs = scaler_kwargs
        self.scaler: torch.amp.GradScaler | None = scaler
        self.step_was_skipped = False
        self.device: str | None = None
        self.precision = self._lightning_name()  # type: ignore[assignment]  # one of Lightning's literal names
        if device is not None:
            self.bind(device)

    def bind(self, device_type: str) -> None:
        """Target ``device_type`` (called by the strategy once it knows its device); validates the combination.

        Raises:
            ValueError: If this precision cannot run on ``device_type``.

        """
        self.check_device(device_type)
        self.device = device_type
        if self._scaler_kwargs is not None and self.mode == "mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(device=device_type, **self._scaler_kwargs.to_kwargs())

    def check_device(self, device_type: str) -> None:
        """Raise ``ValueError`` if this precision cannot run on ``device_type`` (subclasses refine it)."""

    @property
    def device_type(self) -> str:
        """The device type autocast targets."""
        if self.device is None:
            self.bind(default_device_type())
        assert self.device is not None
        return self.device

    def _lightning_name(self) -> str:
        if self.compute_dtype == torch.float32:
            return "32-true"
        prefix = "bf16" if self.compute_dtype == torch.bfloat16 else "16"
        return f"{prefix}-{self.mode}"

    # Autocast / casting.

    def autocast_context_manager(self) -> Any:
        """``torch.autocast`` for ``compute_dtype`` (a no-op context in ``"true"`` mode or for fp32)."""
        if self.mode == "true" or self.compute_dtype == torch.float32:
            return nullcontext()
        kwargs = self.autocast_kwargs.to_kwargs()
        return torch.autocast(self.device_type, dtype=self.compute_dtype, **kwargs)

    @override
    def forward_context(self) -> Any:
        """Autocast in ``"mixed"`` mode; in ``"true"`` mode the compute dtype as default dtype (as ``HalfPrecision``).

        So tensors a forward pass creates (masks, caches, ``torch.zeros``) take the dtype of the converted weights.
        """
        return self.tensor_init_context() if self.mode == "true" else self.autocast_context_manager()

    @override
    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.compute_dtype) if self.mode == "true" else module

    @override
    def tensor_init_context(self) -> Any:
        return _default_dtype(self.compute_dtype) if self.mode == "true" else nullcontext()

    @override
    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.mode != "true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    # Backward and optimizer step, for both call shapes.

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if not _in_trainer(module):
            return tensor  # Fabric ignores the return value; it is scaled in backward() instead
        return super().pre_backward(self._scale(tensor), module)

    @override
    def backward(self, tensor: Tensor, model: Any, optimizer: Any = None, *args: Any, **kwargs: Any) -> None:
        if _in_trainer(model):
            super().backward(tensor, model, optimizer, *args, **kwargs)
        else:
            self._scale(tensor).backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return super().post_backward(tensor, module) if _in_trainer(module) else tensor

    @override
    def optimizer_step(
        self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            self.step_was_skipped = False
            if closure is None:
                return optimizer.step(**kwargs)
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("fp16 gradient scaling cannot drive LBFGS (it re-evaluates the closure); use bf16.")
        if closure is not None:
            closure_result = closure()
            if closure_result is None and model.automatic_optimization:
                return None  # backward was skipped by the user's training_step
            self.scaler.unscale_(optimizer)
            self._after_closure(model, optimizer)
        return self._scaled_step(optimizer, **kwargs)

    def _scaled_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        assert self.scaler is not None
        scale_before = self.scaler.get_scale()
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        # The scaler lowers its scale exactly when it found inf/NaN gradients and skipped the step.
        self.step_was_skipped = self.scaler.get_scale() < scale_before
        return output

    def _scale(self, tensor: Tensor) -> Tensor:
        return self.scaler.scale(tensor) if self.scaler is not None else tensor

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _check_scaler(scaler: object, scaler_kwargs: GradScalerKwargs | None, mode: str) -> None:
    if scaler is None:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"`scaler` must be a torch.amp.GradScaler, got {type(scaler).__name__}.")
    if scaler_kwargs is not None:
        raise ValueError(
            "Got both a `scaler` and `scaler_kwargs`; configure your GradScaler directly, or pass only scaler_kwargs."
        )
    if mode != "mixed":
        raise ValueError(f"mode={mode!r} casts the weights and scales no gradients; drop the scaler or use 'mixed'.")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
