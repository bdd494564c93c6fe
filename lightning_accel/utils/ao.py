"""Accelerate's torchao fp8 helpers: converting ``nn.Linear`` layers to ``Float8Linear`` and the filters it uses.

The ``Accelerator`` converts models itself under ``mixed_precision="fp8"`` with ``AORecipeKwargs`` (see
:class:`lightning_accel.precision.FP8Precision`); these are Accelerate's functions for scripts that call them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from lightning_accel.utils.imports import torchao_required

__all__ = [
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
]


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The qualified names of the first and the last ``nn.Linear`` of ``model`` (``None`` without one)."""
    first = last = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            first = name if first is None else first
            last = name
    return first, last


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list[str | None]) -> bool:
    """Whether to convert ``module`` (named ``fqn``): not a Linear with a dimension not a multiple of 16, not listed."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 != 0 or module.out_features % 16 != 0):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """:func:`filter_linear_layers` leaving out the first and the last Linear found inside ``module`` itself.

    As in Accelerate, the first and last layers are looked up in ``module`` (the layer being asked about when torchao
    calls it), so the first and last layers of a whole model are only left out by :func:`convert_model_to_fp8_ao`'s
    default filter, which looks them up in the model.
    """
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, layers_to_filter=[first, last])


@torchao_required
def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a torchao ``Float8Linear`` (raises ``ImportError`` without torchao)."""
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(module, Float8Linear) for module in model.modules())


@torchao_required
def convert_model_to_fp8_ao(
    model: torch.nn.Module, config: Any = None, module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None
) -> None:
    """Convert ``model``'s ``nn.Linear`` layers to torchao's ``Float8Linear`` in place.

    Args:
        model: The model to convert.
        config: A ``torchao.float8.Float8LinearConfig`` (``None``: torchao's default).
        module_filter_func: ``(module, fqn) -> bool`` choosing the layers; by default every Linear whose dimensions
            are multiples of 16 except the model's first and last (for stability).

    Raises:
        ImportError: Without torchao.

    """
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        first, last = find_first_last_linear_layers(model)
        module_filter_func = functools.partial(filter_linear_layers, layers_to_filter=[first, last])
    convert_to_float8_training(model, module_filter_fn=module_filter_func, config=config)
