"""Accelerate's FP8 recipe kwargs: ``AORecipeKwargs``, ``TERecipeKwargs``, ``MSAMPRecipeKwargs``, ``FP8RecipeKwargs``.

As in Accelerate, an argument left at ``None`` means "not set" and gets its default in ``__post_init__`` (Accelerate
reads ``ACCELERATE_FP8_*`` there; these dataclasses never read the environment, the launcher's variables reach them
through :mod:`lightning_accel.utils.environment`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_accel.config.kwargs import KwargsHandler

__all__ = [
    "AORecipeKwargs",
    "AmaxComputeAlgorithm",
    "Backend",
    "FP8Format",
    "FP8RecipeKwargs",
    "MSAMPRecipeKwargs",
    "OptLevel",
    "TERecipeKwargs",
]

# Accelerate's literal types of the recipe fields.
Backend = Literal["MSAMP", "TE"]
OptLevel = Literal["O1", "O2"]
FP8Format = Literal["HYBRID", "E4M3", "E5M2"]
AmaxComputeAlgorithm = Literal["max", "most_recent"]

_FP8_FORMATS: tuple[str, ...] = get_args(FP8Format)
_AMAX_ALGORITHMS: tuple[str, ...] = get_args(AmaxComputeAlgorithm)
# TERecipeKwargs's defaults, Accelerate's without ACCELERATE_FP8_* variables.
_TE_DEFAULTS: dict[str, Any] = {
    "use_autocast_during_eval": False,
    "margin": 0,
    "interval": 1,
    "fp8_format": "HYBRID",
    "amax_history_len": 1024,
    "amax_compute_algo": "most_recent",
    "override_linear_precision": (False, False, False),
    "use_mxfp8_block_scaling": False,
}


@dataclass
class AORecipeKwargs(KwargsHandler):
    """torchao float8 training settings.

    Attributes:
        config: A ``torchao.float8.Float8LinearConfig``; ``None`` builds Accelerate's default (tensorwise scaling
            with the two switches below). A given config is used as is, except that float8 all-gather is turned off
            where FSDP2 does not shard the model (see ``enable_fsdp_float8_all_gather``).
        module_filter_func: ``(module, fqn) -> bool`` choosing the ``nn.Linear`` layers to convert; ``None`` converts
            every Linear except the first and the last, and those whose dimensions are not multiples of 16.
        pad_inner_dim: Let torchao pad inner dimensions that are not multiples of 16 (``None``: on, Accelerate's
            default; padding adds zeros and changes no result).
        enable_fsdp_float8_all_gather: Under ``acc_fsdp`` with FSDP2, cast the sharded weights of the float8
            Linears to float8 *before* the all-gather (half the traffic of bf16) and refresh their scales with one
            all-reduce after each optimizer step (``None``: on, Accelerate's default). It exists only for FSDP2
            and is off elsewhere (FSDP1 cannot flatten torchao's weight wrapper; under DDP or one device it would
            only replace the weights' ``Parameter`` objects): there the forward casts each weight to float8 itself.

    """

    config: Any = None
    module_filter_func: Callable[[Any, str], bool] | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(f"module_filter_func must be callable or None, got {self.module_filter_func!r}")


@dataclass
class TERecipeKwargs(KwargsHandler):
    """Transformer Engine ``DelayedScaling`` recipe settings (``None``: Accelerate's default, without environment).

    Attributes:
        use_autocast_during_eval: Keep fp8 autocast on in evaluation (default ``False``).
        margin: Margin for the scaling factor computation (default 0).
        interval: How often (in steps) the scaling factor is recomputed (default 1).
        fp8_format: ``HYBRID`` (E4M3 forward, E5M2 backward; the default), ``E4M3`` or ``E5M2``.
        amax_history_len: Length of the amax history window (default 1024).
        amax_compute_algo: ``most_recent`` (the default) or ``max``.
        override_linear_precision: Run the ``(fprop, dgrad, wgrad)`` GEMMs in higher precision (default all
            ``False``).
        use_mxfp8_block_scaling: Use MXFP8 block scaling (Blackwell) instead of delayed scaling (default ``False``).

    """

    # ``None`` (not set) is resolved in ``__post_init__``, so the annotations give the resolved types, as Accelerate's.
    use_autocast_during_eval: bool = None  # type: ignore[assignment]
    margin: int = None  # type: ignore[assignment]
    interval: int = None  # type: ignore[assignment]
    fp8_format: FP8Format = None  # type: ignore[assignment]
    amax_history_len: int = None  # type: ignore[assignment]
    amax_compute_algo: AmaxComputeAlgorithm = None  # type: ignore[assignment]
    override_linear_precision: tuple[bool, bool, bool] = None  # type: ignore[assignment]
    use_mxfp8_block_scaling: bool = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name, default in _TE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        self.fp8_format = str(self.fp8_format).upper()  # type: ignore[assignment]  # checked next
        if self.fp8_format not in _FP8_FORMATS:
            raise ValueError(f"fp8_format must be one of {list(_FP8_FORMATS)}, got {self.fp8_format!r}")
        self.amax_compute_algo = str(self.amax_compute_algo).lower()  # type: ignore[assignment]  # checked next
        if self.amax_compute_algo not in _AMAX_ALGORITHMS:
            raise ValueError(
                f"amax_compute_algo must be one of {list(_AMAX_ALGORITHMS)}, got {self.amax_compute_algo!r}"
            )
        for name in ("margin", "interval", "amax_history_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "margin" else 1):
                raise ValueError(
                    f"{name} must be a {'non-negative' if name == 'margin' else 'positive'} int, got {value!r}"
                )
        if len(tuple(self.override_linear_precision)) != 3:
            got = self.override_linear_precision
            raise ValueError(f"override_linear_precision must be three bools (fprop, dgrad, wgrad), got {got!r}")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP fp8 settings (Accelerate's dataclass; lightning_accel has no MS-AMP backend to run them).

    Attributes:
        opt_level: ``"O1"`` or ``"O2"`` (``None``: ``"O2"``, Accelerate's default without environment).

    """

    opt_level: OptLevel | None = None

    def __post_init__(self) -> None:
        if self.opt_level is None:
            self.opt_level = "O2"
        if self.opt_level not in get_args(OptLevel):
            raise ValueError(f"opt_level must be one of {' or '.join(get_args(OptLevel))}, got {self.opt_level!r}")


@dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in Accelerate, to be removed in 2.0): ``TERecipeKwargs`` and ``MSAMPRecipeKwargs`` in one.

    Use :class:`TERecipeKwargs` or :class:`AORecipeKwargs` instead. Creating one warns with a ``FutureWarning``. The
    fields are Accelerate's, in its order (``opt_level`` first, ``backend`` last).

    Attributes:
        backend: ``"TE"`` (Transformer Engine, the default here) or ``"MSAMP"``, any case. lightning_accel has no
            MS-AMP backend, so ``"MSAMP"`` is refused.
        opt_level: MS-AMP's optimisation level; only meaningful with ``backend="MSAMP"``, so it must stay ``None``.

    """

    backend: Backend | None = None

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated (Accelerate removes it in 2.0): use TERecipeKwargs for Transformer Engine "
            "or AORecipeKwargs for torchao",
            FutureWarning,
            stacklevel=3,
        )
        self.backend = "TE" if self.backend is None else str(self.backend).upper()  # type: ignore[assignment]
        if self.backend == "MSAMP":
            raise ValueError(
                "FP8RecipeKwargs(backend='MSAMP'): lightning_accel has no MS-AMP backend; use TERecipeKwargs "
                "(Transformer Engine) or AORecipeKwargs (torchao)"
            )
        if self.backend != "TE":
            raise ValueError(f"FP8RecipeKwargs backend must be 'TE' or 'MSAMP', got {self.backend!r}")
        if self.opt_level is not None:
            raise ValueError(
                f"FP8RecipeKwargs(opt_level={self.opt_level!r}) sets an MS-AMP level, which the TE backend does not "
                "use; drop opt_level"
            )
        TERecipeKwargs.__post_init__(self)
