"""Kwargs handlers: dataclasses that carry keyword arguments for a torch object the Accelerator builds.

Each handler's :meth:`KwargsHandler.to_kwargs` returns only the fields the user changed, so the torch defaults apply
to everything else.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_accel.config._validation import check_bool, check_number, check_positive_int, check_str
from lightning_accel.enums import DDPCommunicationHookType

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
]


class KwargsHandler:
    """Mixin for dataclasses whose fields are forwarded as keyword arguments.

    The default instance (``type(self)()``) is the reference: :meth:`to_kwargs` keeps the fields whose value differs
    from it. Subclasses must therefore be constructible without arguments.
    """

    def to_dict(self) -> dict[str, Any]:
        """Return a deep copy of the instance attributes."""
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """Return the attributes whose value differs from a default-constructed instance."""
        defaults = type(self)().to_dict()
        return {key: value for key, value in self.to_dict().items() if key not in defaults or defaults[key] != value}


@dataclass
class AutocastKwargs(KwargsHandler):
    """Keyword arguments for ``torch.autocast``.

    Attributes:
        enabled: Whether autocast is active in the regions the Accelerator wraps.
        cache_enabled: Whether autocast caches casted weights; ``None`` keeps torch's default.

    """

    enabled: bool = True
    cache_enabled: bool | None = None

    def __post_init__(self) -> None:
        check_bool("enabled", self.enabled)
        check_bool("cache_enabled", self.cache_enabled, optional=True)


_HOOKS_WITH_STATE = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
_WRAPPERS = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16)


def _to_hook_type(name: str, value: object) -> DDPCommunicationHookType:
    if isinstance(value, DDPCommunicationHookType):
        return value
    if isinstance(value, str) and value.lower() in DDPCommunicationHookType:
        return DDPCommunicationHookType(value.lower())
    raise ValueError(f"{name} must be one of {DDPCommunicationHookType.list()}, got {value!r}")


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keyword arguments for ``torch.nn.parallel.DistributedDataParallel`` plus an optional communication hook.

    Attributes:
        dim: Dimension along which inputs are scattered.
        broadcast_buffers: Whether buffers are broadcast from rank 0 at every forward.
        bucket_cap_mb: Gradient bucket size in MiB.
        find_unused_parameters: Whether DDP traverses the graph to find parameters that got no gradient.
        check_reduction: Deprecated in torch; kept for Accelerate compatibility.
        gradient_as_bucket_view: Whether gradients are views into the all-reduce buckets (saves memory).
        static_graph: Whether the set of used parameters is the same at every iteration.
        comm_hook: Gradient communication hook; a :class:`DDPCommunicationHookType` or its string value.
        comm_wrapper: Compression wrapper around ``comm_hook`` (``no``, ``fp16`` or ``bf16``).
        comm_state_option: Keyword arguments for ``PowerSGDState`` (PowerSGD hooks only).

    ``comm_hook``, ``comm_wrapper`` and ``comm_state_option`` are not DDP constructor arguments, so
    :meth:`to_kwargs` leaves them out; :meth:`register_comm_hook` applies them.

    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an integer, got {self.dim!r}")
        check_number("bucket_cap_mb", self.bucket_cap_mb, exclusive_minimum=0)
        for name in ("broadcast_buffers", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view"):
            check_bool(name, getattr(self, name))
        check_bool("static_graph", self.static_graph)
        self.comm_hook = _to_hook_type("comm_hook", self.comm_hook)
        self.comm_wrapper = _to_hook_type("comm_wrapper", self.comm_wrapper)
        if self.comm_wrapper not in _WRAPPERS:
            raise ValueError(f"comm_wrapper must be one of {[str(w) for w in _WRAPPERS]}, got {self.comm_wrapper}")
        if self.comm_wrapper is not DDPCommunicationHookType.NO and self.comm_hook is DDPCommunicationHookType.NO:
            raise ValueError(
                f"comm_wrapper={self.comm_wrapper} wraps a communication hook, but comm_hook is 'no'; "
                "set comm_hook (for example 'power_sgd') or drop comm_wrapper"
            )
        if not isinstance(self.comm_state_option, dict):
            raise TypeError(f"comm_state_option must be a dict, got {self.comm_state_option!r}")
        if self.comm_state_option and self.comm_hook not in _HOOKS_WITH_STATE:
            raise ValueError(
                f"comm_state_option is only used by the PowerSGD hooks, but comm_hook is {self.comm_hook}; "
                "set comm_hook='power_sgd' or 'batched_power_sgd', or drop comm_state_option"
            )

    def to_dict(
        self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")
    ) -> dict[str, Any]:
        """Return the DDP constructor arguments (the hook settings are left out)."""
        return {key: value for key, value in super().to_dict().items() if key not in ignore_keys}

    def register_comm_hook(self, model: DistributedDataParallel) -> None:
        """Register the configured communication hook (if any) on an already wrapped DDP ``model``."""
        if self.comm_hook is DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook: Any = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        state = None
        if self.comm_hook in _HOOKS_WITH_STATE:
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Keyword arguments for ``torch.amp.GradScaler`` (fp16 training).

    Attributes:
        init_scale: Initial loss scale.
        growth_factor: Factor the scale grows by after ``growth_interval`` finite steps; must be > 1.
        backoff_factor: Factor the scale shrinks by after a step with inf/NaN gradients; must be in (0, 1).
        growth_interval: Number of consecutive finite steps before the scale grows.
        enabled: Whether the scaler is active.

    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        check_number("init_scale", self.init_scale, exclusive_minimum=0)
        check_number("growth_factor", self.growth_factor, exclusive_minimum=1)
        check_number("backoff_factor", self.backoff_factor, exclusive_minimum=0, exclusive_maximum=1)
        check_positive_int("growth_interval", self.growth_interval)
        check_bool("enabled", self.enabled)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Keyword arguments for ``torch.distributed.init_process_group``.

    Attributes:
        backend: Process group backend (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...).
        init_method: Rendezvous URL; ``None`` uses the ``env://`` variables set by the launcher.
        timeout: Collective timeout. ``None`` means torch's default for the backend (10 minutes for NCCL, 30
            minutes otherwise), which are the values Accelerate writes into this field; here the field stays
            ``None`` so that ``to_kwargs()`` only reports what the user set.

    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        check_str("backend", self.backend, optional=True)
        check_str("init_method", self.init_method, optional=True)
        if self.timeout is not None:
            if not isinstance(self.timeout, timedelta):
                raise TypeError(
                    f"timeout must be a datetime.timedelta or None, got {self.timeout!r}; "
                    "write for example timeout=timedelta(seconds=1800)"
                )
            if self.timeout <= timedelta(0):
                raise ValueError(f"timeout must be a positive duration, got {self.timeout!r}")
