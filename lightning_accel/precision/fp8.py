"""Accelerate's ``fp8``: float8 matmuls through torchao (default) or NVIDIA Transformer Engine."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import Module
from typing_extensions import override

from lightning_accel.config import AutocastKwargs
from lightning_accel.config.fp8 import AORecipeKwargs, TERecipeKwargs
from lightning_accel.precision.base import AcceleratePrecision

_BACKENDS = {
    "ao": ("torchao", "pip install 'lightning-accel[fp8]' (torchao)"),
    "te": ("transformer_engine", "pip install transformer-engine[pytorch] (NVIDIA Transformer Engine)"),
}


class FP8Precision(AcceleratePrecision):
    """float8 training: selected ``nn.Linear`` layers compute in fp8, the rest under bf16 autocast.

    Args:
        backend: ``"ao"`` (torchao's ``Float8Linear``, the default) or ``"te"`` (Transformer Engine).
        recipe_kwargs: ``AORecipeKwargs`` for torchao, ``TERecipeKwargs`` for Transformer Engine.
        device: The device type; ``None`` lets the strategy set it. fp8 needs CUDA compute capability 8.9 or newer.
        autocast_kwargs: Accelerate's ``AutocastKwargs`` for the bf16 autocast around the fp8 layers.

    Raises:
        ValueError: For an unknown backend or recipe type.
        ModuleNotFoundError: If the backend package is not installed.

    """

    precision_type = "fp8"

    def __init__(
        self,
        backend: Literal["ao", "te"] = "ao",
        recipe_kwargs: AORecipeKwargs | TERecipeKwargs | None = None,
        device: str | None = None,
        autocast_kwargs: AutocastKwargs | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"FP8Precision(backend={backend!r}) is unknown; use 'ao' (torchao) or 'te'.")
        expected = AORecipeKwargs if backend == "ao" else TERecipeKwargs
        if recipe_kwargs is not None and not isinstance(recipe_kwargs, expected):
            raise ValueError(
                f"backend={backend!r} takes {expected.__name__} recipe kwargs, got {type(recipe_kwargs).__name__}."
            )
        module, hint = _BACKENDS[backend]
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"fp8 with backend={backend!r} needs the `{module}` package: {hint}.")
        self.backend = backend
        self.recipe_kwargs = recipe_kwargs or expected()
        self.fsdp_version: int | None = None
        super().__init__(torch.bfloat16, device=device, autocast_kwargs=autocast_kwargs)
        self.precision = "transformer-engine" if backend == "te" else "bf16-mixed"

    def check_device(self, device_type: str) -> None:
        """fp8 matmuls need an NVIDIA GPU of compute capability 8.9 (Ada) or newer.

        Raises:
            ValueError: On any other device.

        """
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"fp8 training needs an NVIDIA GPU with compute capability >= 8.9 (Ada, Hopper or newer), but this run"
                f" trains on {device_type!r}. Use bf16 instead."
            )
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(
                f"fp8 training needs compute capability >= 8.9, but {torch.cuda.get_device_name()} has"
                f" {capability[0]}.{capability[1]}. Use bf16 instead."
            )

    def shard_with_fsdp(self, version: int) -> None:
        """Called by ``acc_fsdp`` before the conversion: FSDP ``version`` (1 or 2) will shard the converted model.

        Under FSDP2 the torchao conversion wraps the float8 Linears' weights for float8 all-gather (see
        :meth:`float8_linear_config`).
        """
        self.fsdp_version = version

    @override
    def convert_module(self, module: Module) -> Module:
        if self.backend == "ao":
            return self._convert_ao(module)
        return self._convert_te(module)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager(), self.fp8_context():
            yield

    def fp8_context(self) -> AbstractContextManager:
        """The backend's own fp8 context: Transformer Engine's ``fp8_autocast``; torchao needs none (a no-op).

        Strategies whose engine owns the bf16 casting (DeepSpeed) enter only this one around the forward.
        """
        if self.backend != "te":
            return nullcontext()
        import transformer_engine.pytorch as te

        return te.fp8_autocast(enabled=True, fp8_recipe=self._te_recipe())

    def float8_linear_config(self) -> Any:
        """The torchao ``Float8LinearConfig`` the Linears are converted with (the ``"ao"`` backend).

        The recipe's ``config`` if it has one, else Accelerate's default: ``pad_inner_dim`` and
        ``enable_fsdp_float8_all_gather`` on unless the recipe turns them off. Float8 all-gather is kept only where
        FSDP2 shards the model: elsewhere it would replace the weights' ``Parameter`` objects (an optimizer created
        before ``fabric.setup`` would keep the old ones) and break FSDP1 (it cannot flatten torchao's weight
        wrapper), while the forward casts the weights to float8 with the same scales anyway.
        """
        import dataclasses

        from torchao.float8 import Float8LinearConfig

        kwargs = self.recipe_kwargs
        assert isinstance(kwargs, AORecipeKwargs)
        under_fsdp2 = self.fsdp_version == 2
        if kwargs.config is not None:
            config = kwargs.config
            if config.enable_fsdp_float8_all_gather and not under_fsdp2:
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
            return config
        return Float8LinearConfig(
            pad_inner_dim=kwargs.pad_inner_dim is not False,
            enable_fsdp_float8_all_gather=under_fsdp2 and kwargs.enable_fsdp_float8_all_gather is not False,
        )

    def _convert_ao(self, module: Module) -> Module:
        from torchao.float8 import convert_to_float8_training

        assert isinstance(self.recipe_kwargs, AORecipeKwargs)
        filter_fn = self.recipe_kwargs.module_filter_func or _default_ao_filter(module)
        convert_to_float8_training(module, config=self.float8_linear_config(), module_filter_fn=filter_fn)
        return module

    def _convert_te(self, module: Module) -> Module:
        import transformer_engine.pytorch as te

        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and _fp8_friendly(child):
                replacement = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                replacement.weight.data.copy_(child.weight.data)
                if child.bias is not None:
                    replacement.bias.data.copy_(child.bias.data)
                setattr(module, name, replacement)
            else:
                self._convert_te(child)
        return module

    def _te_recipe(self) -> Any:
        from transformer_engine.common import recipe

        kwargs = self.recipe_kwargs
        assert isinstance(kwargs, TERecipeKwargs)
        return recipe.DelayedScaling(
            margin=kwargs.margin,
            interval=kwargs.interval,
            fp8_format=getattr(recipe.Format, kwargs.fp8_format),
            amax_history_len=kwargs.amax_history_len,
            amax_compute_algo=kwargs.amax_compute_algo,
            override_linear_precision=kwargs.override_linear_precision,
        )


def _fp8_friendly(linear: nn.Linear) -> bool:
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def _default_ao_filter(root: Module) -> Any:
    """Accelerate's default: every fp8-friendly Linear except the first and the last (for stability)."""
    linears = [name for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()

    def keep(module: Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn not in edges and _fp8_friendly(module)

    return keep


def float8_all_gather_modules(module: Module) -> list[Module]:
    """The torchao ``Float8Linear`` layers of ``module`` whose FSDP2-sharded weights are all-gathered in float8."""
    if "torchao" not in sys.modules:  # nothing can be converted without it having been imported
        return []
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [
        m
        for m in module.modules()
        if isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


def refresh_float8_scales(module: Module) -> None:
    """Recompute the float8 scales of ``module``'s float8-all-gathered weights (one all-reduce for all of them).

    torchao's ``precompute_float8_dynamic_scale_for_fsdp``, which Accelerate runs after every optimizer step under
    FSDP2 (without it, each weight's all-gather first all-reduces its own amax). Call it also after loading weights
    into such a module: the scales precomputed before would be stale. A collective: every rank calls it. Nothing
    happens for modules without float8-all-gathered weights.
    """
    if not float8_all_gather_modules(module):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
