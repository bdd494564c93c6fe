"""Fully Sharded Data Parallel settings (FSDP1 wrapper and FSDP2 ``fully_shard``).

The plugin stores torch's FSDP enums by name (``"FULL_SHARD"``, ``"SHARDED_STATE_DICT"``, ...), so building and
validating it does not import ``torch.distributed.fsdp``. The ``torch_*`` methods and
:meth:`FullyShardedDataParallelPlugin.build_auto_wrap_policy` convert to torch objects when a strategy needs them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.config._validation import (
    check_bool,
    check_callable,
    check_non_negative_int,
    check_str_list,
    fill_none_with_defaults,
    normalize_enum_name,
)

if TYPE_CHECKING:
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        MixedPrecisionPolicy,
        OffloadPolicy,
        ShardingStrategy,
        StateDictType,
    )

__all__ = [
    "FSDP2_STATE_DICT_TYPE",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_STATE_DICT_TYPE",
    "FullyShardedDataParallelPlugin",
]

# Orders match torch's 1-based enum values (HYBRID_SHARD_ZERO2 is torch's ``_HYBRID_SHARD_ZERO2``).
FSDP_SHARDING_STRATEGY = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
FSDP_AUTO_WRAP_POLICY = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_STATE_DICT_TYPE = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
FSDP2_STATE_DICT_TYPE = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")

_MIXED_PRECISION_DTYPES = {"fp8": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Boolean fields Accelerate fills from FSDP_* variables (falling back to False); `None` means False here.
_FALSE_BY_DEFAULT = (
    "cpu_offload",
    "activation_checkpointing",
    "activation_checkpointing_offload",
    "cpu_ram_efficient_loading",
)
_FSDP2_ONLY_HINT = "it has no effect with fsdp_version=2 and is set to None"


def _warn_ignored(field: str, value: object) -> None:
    warnings.warn(f"{field}={value!r} is an FSDP1 setting; {_FSDP2_ONLY_HINT}", UserWarning, stacklevel=4)


def _find_module_class(model: torch.nn.Module, class_name: str) -> type[torch.nn.Module] | None:
    for module in model.modules():
        if type(module).__name__ == class_name:
            return type(module)
    return None


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings for Fully Sharded Data Parallel training, with Accelerate 1.15's fields.

    ``fsdp_version`` defaults to ``2`` (``torch.distributed.fsdp.fully_shard``). Accelerate's dataclass default is
    ``None`` and it then reads ``FSDP_VERSION`` from the environment, falling back to ``1``; this class never reads the
    environment. Fields left as ``None`` are resolved from ``fsdp_version`` the way Accelerate resolves them when no
    ``FSDP_*`` variable is set, and ``None`` in the boolean fields that default to ``False`` means ``False``.

    Attributes:
        fsdp_version: ``1`` (``FullyShardedDataParallel`` wrapper) or ``2`` (``fully_shard``).
        sharding_strategy: FSDP1 sharding strategy name (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``,
            ``HYBRID_SHARD``, ``HYBRID_SHARD_ZERO2``), its 1-based index, or a ``ShardingStrategy``; stored as the
            name. Defaults to ``FULL_SHARD`` with FSDP1; ignored (with a warning) with FSDP2.
        reshard_after_forward: With FSDP2, a bool (default ``True``); with FSDP1, a sharding strategy accepted as an
            alias of ``sharding_strategy``.
        backward_prefetch: ``BACKWARD_PRE``, ``BACKWARD_POST`` or ``NO_PREFETCH``/``None`` (FSDP1 only).
        mixed_precision_policy: ``None``, a precision string (``fp8``, ``fp16``, ``bf16``, ``fp32``), a dict of
            dtypes (``param_dtype``, ``reduce_dtype`` and ``buffer_dtype`` for FSDP1 or ``output_dtype`` for FSDP2),
            or a torch ``MixedPrecision`` (FSDP1) / ``MixedPrecisionPolicy`` (FSDP2).
        auto_wrap_policy: ``"transformer_based_wrap"``, ``"size_based_wrap"``, ``"no_wrap"``/``None`` or a torch
            auto-wrap callable; strings are stored lower-case and ``"no_wrap"`` becomes ``None``.
        cpu_offload: Whether parameters are offloaded to CPU, or a torch ``CPUOffload`` (FSDP1) /
            ``OffloadPolicy`` (FSDP2).
        ignored_modules: Modules FSDP leaves alone, or a regex matched against module names.
        state_dict_type: ``FULL_STATE_DICT``, ``SHARDED_STATE_DICT`` or (FSDP1 only) ``LOCAL_STATE_DICT``; defaults
            to full with FSDP1 and sharded with FSDP2.
        state_dict_config: torch state-dict config; ``None`` lets :meth:`torch_state_dict_configs` derive it.
        optim_state_dict_config: torch optimizer state-dict config; ``None`` derives it as above.
        limit_all_gathers: Whether FSDP1 rate-limits in-flight all-gathers.
        use_orig_params: FSDP1 only (default ``False``): expose the original parameters to the optimizer.
        param_init_fn: How modules on the meta device are materialised.
        sync_module_states: FSDP1 only (default ``False``): broadcast rank 0's weights after wrapping.
        forward_prefetch: FSDP1 only (default ``False``): prefetch the next all-gather during forward.
        activation_checkpointing: Whether wrapped layers recompute activations in backward.
        activation_checkpointing_offload: Whether checkpointed inputs are offloaded to CPU (FSDP2 and
            ``activation_checkpointing`` only).
        cpu_ram_efficient_loading: Whether only rank 0 loads pretrained weights (forces ``sync_module_states``
            with FSDP1).
        transformer_cls_names_to_wrap: Layer class names wrapped by ``transformer_based_wrap``; a comma-separated
            string is split. ``None`` uses the model's ``_no_split_modules``.
        min_num_params: Parameter threshold of ``size_based_wrap`` (``0`` if unset, which disables wrapping).

    """

    fsdp_version: int = 2
    sharding_strategy: str | ShardingStrategy | int | None = None
    reshard_after_forward: bool | str | ShardingStrategy | None = None
    backward_prefetch: str | BackwardPrefetch | None = None
    mixed_precision_policy: dict[str, torch.dtype] | str | MixedPrecision | MixedPrecisionPolicy | None = None
    auto_wrap_policy: Callable[..., Any] | str | None = None
    cpu_offload: bool | CPUOffload | OffloadPolicy = False
    ignored_modules: Iterable[torch.nn.Module] | str | None = None
    state_dict_type: str | StateDictType | None = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False
    cpu_ram_efficient_loading: bool = False
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fsdp_version, bool) or self.fsdp_version not in (1, 2):
            raise ValueError(
                f"fsdp_version must be one of [1, 2] (1: FullyShardedDataParallel, 2: fully_shard), "
                f"got {self.fsdp_version!r}"
            )
        fill_none_with_defaults(self, _FALSE_BY_DEFAULT)
        self._resolve_sharding()
        self._resolve_fsdp1_only_options()
        self._validate_mixed_precision()
        self._validate_cpu_offload()
        self.set_state_dict_type()
        self._resolve_auto_wrap()
        for name in ("limit_all_gathers", *_FALSE_BY_DEFAULT[1:]):
            check_bool(name, getattr(self, name))
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("activation_checkpointing_offload=True requires activation_checkpointing=True")
        if self.activation_checkpointing_offload and self.fsdp_version != 2:
            raise ValueError("activation_checkpointing_offload=True requires fsdp_version=2")
        if self.fsdp_version == 1 and self.cpu_ram_efficient_loading and not self.sync_module_states:
            warnings.warn(
                "cpu_ram_efficient_loading=True needs sync_module_states=True with fsdp_version=1; enabling it",
                UserWarning,
                stacklevel=3,
            )
            self.sync_module_states = True
        check_callable("param_init_fn", self.param_init_fn)
        if self.ignored_modules is not None and not isinstance(self.ignored_modules, (str, Iterable)):
            raise TypeError(
                f"ignored_modules must be an iterable of modules, a regex string or None, got {self.ignored_modules!r}"
            )

    def _resolve_sharding(self) -> None:
        if self.fsdp_version == 2:
            if self.sharding_strategy is not None:
                self.sharding_strategy = normalize_enum_name(
                    "sharding_strategy", self.sharding_strategy, FSDP_SHARDING_STRATEGY
                )
                warnings.warn(
                    f"sharding_strategy={self.sharding_strategy!r} is ignored with fsdp_version=2; use "
                    "reshard_after_forward=True (like FULL_SHARD) or False (like SHARD_GRAD_OP), or fsdp_version=1",
                    UserWarning,
                    stacklevel=4,
                )
            value = True if self.reshard_after_forward is None else self.reshard_after_forward
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                value = value.strip().lower() == "true"
            if not isinstance(value, bool):
                raise ValueError(
                    f"reshard_after_forward must be a bool with fsdp_version=2, got {value!r}; "
                    "sharding strategy names are FSDP1 settings (pass fsdp_version=1 to use them)"
                )
            self.reshard_after_forward = value
            return
        if isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward must be a sharding strategy name with fsdp_version=1, got "
                f"{self.reshard_after_forward!r}; booleans are for fsdp_version=2"
            )
        strategy = None
        if self.sharding_strategy is not None:
            strategy = normalize_enum_name("sharding_strategy", self.sharding_strategy, FSDP_SHARDING_STRATEGY)
        alias = None
        if self.reshard_after_forward is not None:
            alias = normalize_enum_name("reshard_after_forward", self.reshard_after_forward, FSDP_SHARDING_STRATEGY)
        if strategy is not None and alias is not None and strategy != alias:
            raise ValueError(
                f"sharding_strategy={strategy!r} and reshard_after_forward={alias!r} disagree; with fsdp_version=1 "
                "both name the sharding strategy, so set only one of them"
            )
        self.sharding_strategy = strategy or alias or "FULL_SHARD"
        self.reshard_after_forward = alias

    def _resolve_fsdp1_only_options(self) -> None:
        if self.backward_prefetch is not None:
            prefetch = normalize_enum_name("backward_prefetch", self.backward_prefetch, FSDP_BACKWARD_PREFETCH)
            self.backward_prefetch = None if prefetch == "NO_PREFETCH" else prefetch
        if self.fsdp_version == 1:
            for name in ("use_orig_params", "sync_module_states", "forward_prefetch"):
                if getattr(self, name) is None:
                    setattr(self, name, False)
                check_bool(name, getattr(self, name))
            return
        if self.forward_prefetch:
            raise ValueError("forward_prefetch=True is not supported with fsdp_version=2; use fsdp_version=1")
        self.forward_prefetch = None
        for name in ("backward_prefetch", "use_orig_params", "sync_module_states"):
            if getattr(self, name) is not None:
                _warn_ignored(name, getattr(self, name))
                setattr(self, name, None)
        if self.param_init_fn is not None:  # fully_shard takes none; FSDP2 materializes meta modules with to_empty
            check_callable("param_init_fn", self.param_init_fn)
            _warn_ignored("param_init_fn", self.param_init_fn)
            self.param_init_fn = None
        if self.limit_all_gathers is False:  # FSDP2 always limits in-flight all-gathers
            warnings.warn(
                "limit_all_gathers=False is an FSDP1 setting; it has no effect with fsdp_version=2", UserWarning, 4
            )

    def _validate_mixed_precision(self) -> None:
        policy = self.mixed_precision_policy
        if policy is None:
            return
        if isinstance(policy, str):
            if policy not in _MIXED_PRECISION_DTYPES:
                raise ValueError(
                    f"mixed_precision_policy must be one of {list(_MIXED_PRECISION_DTYPES)} when a string, "
                    f"got {policy!r}"
                )
            return
        if isinstance(policy, dict):
            keys = {"param_dtype", "reduce_dtype", "buffer_dtype" if self.fsdp_version == 1 else "output_dtype"}
            allowed_dtypes = set(_MIXED_PRECISION_DTYPES.values())
            bad_values = {k: v for k, v in policy.items() if v not in allowed_dtypes}
            if set(policy) != keys or bad_values:
                raise ValueError(
                    f"mixed_precision_policy as a dict must have exactly the keys {sorted(keys)} for "
                    f"fsdp_version={self.fsdp_version}, with values in {sorted(map(str, allowed_dtypes))}; "
                    f"got {policy!r}"
                )
            return
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        expected = MixedPrecision if self.fsdp_version == 1 else MixedPrecisionPolicy
        if not isinstance(policy, expected):
            raise TypeError(
                f"mixed_precision_policy must be a string, a dict or a torch.distributed.fsdp.{expected.__name__} "
                f"with fsdp_version={self.fsdp_version}, got {policy!r}"
            )

    def _validate_cpu_offload(self) -> None:
        if isinstance(self.cpu_offload, bool):
            return
        from torch.distributed.fsdp import CPUOffload, OffloadPolicy

        expected = CPUOffload if self.fsdp_version == 1 else OffloadPolicy
        if not isinstance(self.cpu_offload, expected):
            raise TypeError(
                f"cpu_offload must be a bool or a torch.distributed.fsdp.{expected.__name__} with "
                f"fsdp_version={self.fsdp_version}, got {self.cpu_offload!r}"
            )

    def _resolve_auto_wrap(self) -> None:
        policy = self.auto_wrap_policy
        if isinstance(policy, str):
            if policy.upper() not in FSDP_AUTO_WRAP_POLICY:
                raise ValueError(
                    f"auto_wrap_policy must be one of {[p.lower() for p in FSDP_AUTO_WRAP_POLICY]}, None or a "
                    f"callable, got {policy!r}"
                )
            self.auto_wrap_policy = None if policy.upper() == "NO_WRAP" else policy.lower()
        elif policy is not None and not callable(policy):
            raise TypeError(f"auto_wrap_policy must be a string, a callable or None, got {policy!r}")
        if isinstance(self.transformer_cls_names_to_wrap, str):
            names = self.transformer_cls_names_to_wrap.split(",")
            self.transformer_cls_names_to_wrap = [name.strip() for name in names if name.strip()]
        check_str_list("transformer_cls_names_to_wrap", self.transformer_cls_names_to_wrap)
        if self.auto_wrap_policy == "size_based_wrap" and self.min_num_params is None:
            self.min_num_params = 0
        check_non_negative_int("min_num_params", self.min_num_params, optional=True)

    def set_state_dict_type(self, state_dict_type: str | StateDictType | None = None) -> None:
        """Validate and store the state-dict type, optionally replacing it (e.g. full for a final save).

        Args:
            state_dict_type: New type; ``None`` keeps the current one, resolving an unset one to the version's
                default (``FULL_STATE_DICT`` for FSDP1, ``SHARDED_STATE_DICT`` for FSDP2).

        """
        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
        allowed = FSDP_STATE_DICT_TYPE if self.fsdp_version == 1 else FSDP2_STATE_DICT_TYPE
        name = normalize_enum_name("state_dict_type", self.state_dict_type, FSDP_STATE_DICT_TYPE)
        if name not in allowed:
            raise ValueError(f"state_dict_type must be one of {list(allowed)} with fsdp_version=2, got {name!r}")
        self.state_dict_type = name

    # Lazy conversions to torch objects, for strategies.

    def torch_sharding_strategy(self) -> ShardingStrategy:
        """Return the FSDP1 ``ShardingStrategy`` member named by ``sharding_strategy``."""
        from torch.distributed.fsdp import ShardingStrategy

        name = self.sharding_strategy if isinstance(self.sharding_strategy, str) else "FULL_SHARD"
        return ShardingStrategy(FSDP_SHARDING_STRATEGY.index(name) + 1)

    def torch_backward_prefetch(self) -> BackwardPrefetch | None:
        """Return the ``BackwardPrefetch`` member for ``backward_prefetch``, or ``None``."""
        from torch.distributed.fsdp import BackwardPrefetch

        if not isinstance(self.backward_prefetch, str):
            return None
        return BackwardPrefetch[self.backward_prefetch]

    def torch_state_dict_type(self) -> StateDictType:
        """Return the ``StateDictType`` member for ``state_dict_type``."""
        from torch.distributed.fsdp import StateDictType

        return StateDictType[str(self.state_dict_type)]

    def torch_state_dict_configs(self) -> tuple[Any, Any]:
        """Return ``(state_dict_config, optim_state_dict_config)``, derived from the type where unset.

        Full state dicts are gathered on rank 0 and offloaded to CPU; sharded ones are offloaded to CPU, as in
        Accelerate.
        """
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
        )

        model_config, optim_config = self.state_dict_config, self.optim_state_dict_config
        if self.state_dict_type == "FULL_STATE_DICT":
            model_config = model_config or FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            optim_config = optim_config or FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        elif self.state_dict_type == "SHARDED_STATE_DICT":
            model_config = model_config or ShardedStateDictConfig(offload_to_cpu=True)
            optim_config = optim_config or ShardedOptimStateDictConfig(offload_to_cpu=True)
        return model_config, optim_config

    def torch_mixed_precision(self) -> MixedPrecision | MixedPrecisionPolicy | None:
        """Return the torch mixed-precision object for this FSDP version, or ``None``."""
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if policy is None or isinstance(policy, (MixedPrecision, MixedPrecisionPolicy)):
            return policy
        dtypes: dict[str, Any] = dict(policy) if isinstance(policy, dict) else {}
        if isinstance(policy, str):
            dtype = _MIXED_PRECISION_DTYPES[policy]
            last_key = "buffer_dtype" if self.fsdp_version == 1 else "output_dtype"
            dtypes = {"param_dtype": dtype, "reduce_dtype": dtype, last_key: dtype}
        if self.fsdp_version == 1:
            return MixedPrecision(**dtypes)
        return MixedPrecisionPolicy(**dtypes)

    def torch_cpu_offload(self) -> CPUOffload | OffloadPolicy:
        """Return ``CPUOffload`` (FSDP1) or ``OffloadPolicy`` / ``CPUOffloadPolicy`` (FSDP2) for ``cpu_offload``."""
        from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

        if not isinstance(self.cpu_offload, bool):
            return self.cpu_offload
        if self.fsdp_version == 1:
            return CPUOffload(offload_params=self.cpu_offload)
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Replace a named ``auto_wrap_policy`` with torch's policy callable for ``model`` (Accelerate's method).

        ``transformer_based_wrap`` without ``transformer_cls_names_to_wrap`` takes the model's ``_no_split_modules``
        (recorded in ``transformer_cls_names_to_wrap``); ``size_based_wrap`` with ``min_num_params == 0`` becomes
        ``None`` (no wrapping). A callable or ``None`` is kept. See :meth:`build_auto_wrap_policy`.

        Raises:
            ValueError: If a class name to wrap is not found in ``model``.

        """
        if not isinstance(self.auto_wrap_policy, str):
            return
        if self.auto_wrap_policy == "transformer_based_wrap" and self.transformer_cls_names_to_wrap is None:
            self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
        self.auto_wrap_policy = self.build_auto_wrap_policy(model)

    def build_auto_wrap_policy(self, model: torch.nn.Module) -> Callable[..., Any] | None:
        """Return a torch auto-wrap policy callable for ``model``, or ``None`` for no wrapping.

        ``transformer_based_wrap`` looks the class names up in ``model`` (``transformer_cls_names_to_wrap``, else the
        model's ``_no_split_modules``); ``size_based_wrap`` with ``min_num_params == 0`` disables wrapping.

        Raises:
            ValueError: If a class name to wrap is not found in ``model``.

        """
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        policy = self.auto_wrap_policy
        if policy is None or callable(policy):
            return policy
        if policy == "transformer_based_wrap":
            names = self.transformer_cls_names_to_wrap
            if names is None:
                names = list(getattr(model, "_no_split_modules", None) or [])
            layer_classes = set()
            for name in names:
                layer_class = _find_module_class(model, name)
                if layer_class is None:
                    raise ValueError(
                        f"transformer_cls_names_to_wrap names {name!r}, but the model has no module of that class"
                    )
                layer_classes.add(layer_class)
            return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
        if self.min_num_params:
            return functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)
        return None
