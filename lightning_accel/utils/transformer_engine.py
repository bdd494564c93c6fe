"""Accelerate's Transformer Engine helpers: converting layers, finding them, and fp8 autocast around a forward.

They need NVIDIA's ``transformer_engine`` (Intel's ``intel_transformer_engine`` on Gaudi) and raise ``ImportError``
without it, as Accelerate's do. The ``Accelerator`` itself runs Transformer Engine fp8 through
:class:`lightning_accel.precision.FP8Precision`; these are for scripts that call them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn

from lightning_accel.utils.imports import is_hpu_available, is_transformer_engine_available
from lightning_accel.utils.operations import GatheredParameters

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model", "has_transformer_engine_layers"]


def _require(what: str) -> None:
    if not is_transformer_engine_available():
        raise ImportError(f"Using `{what}` requires transformer_engine to be installed.")


def _te() -> Any:
    if is_hpu_available():
        import intel_transformer_engine as te

        if not hasattr(te, "LayerNorm"):  # Gaudi's Transformer Engine has no LayerNorm: torch's serves
            te.LayerNorm = nn.LayerNorm
        return te
    import transformer_engine.pytorch as te

    return te


@torch.no_grad()
def convert_model(
    model: nn.Module, to_transformer_engine: bool = True, _convert_linear: bool = True, _convert_ln: bool = True
) -> None:
    """Replace ``nn.Linear``/``nn.LayerNorm`` children by Transformer Engine's (or back), recursively, in place.

    As in Accelerate, the conversion of a module's children stops at the first ``nn.Linear`` whose dimensions are not
    multiples of 16 (fp8 GEMMs need them); weights are copied (gathered first under ZeRO-3).

    Raises:
        ImportError: Without Transformer Engine.

    """
    _require("convert_model")
    te = _te()
    for name, module in model.named_children():
        if isinstance(module, nn.Linear) and to_transformer_engine and _convert_linear:
            has_bias = module.bias is not None
            params = [module.weight, *([module.bias] if has_bias else [])]
            with GatheredParameters(params, modifier_rank=0):
                if any(size % 16 != 0 for size in module.weight.shape):
                    return
                new = te.Linear(
                    module.in_features, module.out_features, bias=has_bias, params_dtype=module.weight.dtype
                )
                new.weight.copy_(module.weight)
                if has_bias:
                    new.bias.copy_(module.bias)
                setattr(model, name, new)
        elif isinstance(module, nn.LayerNorm) and to_transformer_engine and _convert_ln:
            with GatheredParameters([module.weight, module.bias], modifier_rank=0):
                new = te.LayerNorm(module.normalized_shape[0], eps=module.eps, params_dtype=module.weight.dtype)
                new.weight.copy_(module.weight)
                if module.bias is not None:
                    new.bias.copy_(module.bias)
            setattr(model, name, new)
        elif isinstance(module, te.Linear) and not to_transformer_engine and _convert_linear:
            has_bias = module.bias is not None
            plain = nn.Linear(module.in_features, module.out_features, bias=has_bias, dtype=module.weight.dtype)
            plain.weight.copy_(module.weight)
            if has_bias:
                plain.bias.copy_(module.bias)
            setattr(model, name, plain)
        elif isinstance(module, te.LayerNorm) and not to_transformer_engine and _convert_ln:
            plain_norm = nn.LayerNorm(module.normalized_shape[0], eps=module.eps, dtype=module.weight.dtype)
            plain_norm.weight.copy_(module.weight)
            plain_norm.bias.copy_(module.bias)
            setattr(model, name, plain_norm)
        else:
            convert_model(
                module,
                to_transformer_engine=to_transformer_engine,
                _convert_linear=_convert_linear,
                _convert_ln=_convert_ln,
            )


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a Transformer Engine ``Linear``, ``LayerNorm`` or ``TransformerLayer``.

    Raises:
        ImportError: Without Transformer Engine.

    """
    _require("has_transformer_engine_layers")
    te = _te()
    classes = te.Linear if is_hpu_available() else (te.LayerNorm, te.Linear, te.TransformerLayer)
    return any(isinstance(m, classes) for m in model.modules())


def contextual_fp8_autocast(
    model_forward: Callable[..., Any], fp8_recipe: Any, use_during_eval: bool = False
) -> Callable[..., Any]:
    """A forward method running ``model_forward`` under Transformer Engine's ``fp8_autocast`` while training.

    In evaluation (``module.training`` false) fp8 is off unless ``use_during_eval``. The result takes ``self`` first
    (bind it to the module); its ``__wrapped__`` is ``model_forward``, so unwrapping removes it.

    Raises:
        ImportError: Without Transformer Engine.

    """
    _require("contextual_fp8_autocast")
    if is_hpu_available():
        from intel_transformer_engine import fp8_autocast
    else:
        from transformer_engine.pytorch import fp8_autocast

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fp8_autocast(enabled=use_during_eval or self.training, fp8_recipe=fp8_recipe):
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward  # type: ignore[attr-defined]
    return forward


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: Any) -> nn.Module:
    """Wrap ``model.forward`` in :func:`contextual_fp8_autocast` with the recipe a ``TERecipeKwargs`` describes.

    ``DelayedScaling`` by default, ``MXFP8BlockScaling`` with ``use_mxfp8_block_scaling`` (where the GPU has it).

    Raises:
        ImportError: Without Transformer Engine.
        ValueError: For MXFP8 block scaling where it is unavailable, or with an amax setting it does not take.

    """
    _require("apply_fp8_autowrap")
    if is_hpu_available():
        import intel_transformer_engine.recipe as te_recipe

        block_scaling, message = False, "MXFP8 block scaling is not available on HPU."
    else:
        import transformer_engine.common.recipe as te_recipe
        from transformer_engine.pytorch.fp8 import check_mxfp8_support

        block_scaling, message = check_mxfp8_support()
    kwargs = fp8_recipe_handler.to_kwargs() if fp8_recipe_handler is not None else {}
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    use_during_eval = kwargs.pop("use_autocast_during_eval", False)
    mxfp8 = kwargs.pop("use_mxfp8_block_scaling", False)
    if mxfp8 and not block_scaling:
        raise ValueError(f"MXFP8 block scaling is not available: {message}")
    if mxfp8:
        for name in ("amax_compute_algo", "amax_history_len"):
            if name in kwargs:
                raise ValueError(f"`{name}` is not supported for MXFP8 block scaling.")
        recipe = te_recipe.MXFP8BlockScaling(**kwargs)
    else:
        recipe = te_recipe.DelayedScaling(**kwargs)
    new_forward = contextual_fp8_autocast(model.forward, recipe, use_during_eval)
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(new_forward, model)
    else:
        model.forward = new_forward
    return model
