"""Mirror of ``accelerate.utils.deepspeed``: DeepSpeed's placeholders, the active plugin, config and engine helpers.

With ``"optimizer"`` / ``"scheduler"`` sections in the DeepSpeed config, an Accelerate script passes
``DummyOptim(params, lr=..., weight_decay=...)`` and ``DummyScheduler(optimizer, total_num_steps=...,
warmup_num_steps=...)`` to ``accelerator.prepare``; DeepSpeed builds the real ones from the config, with its
``"auto"`` entries filled from the dummies' arguments (see :mod:`lightning_accel.strategies.deepspeed_prepare`).
Prepare returns the engine's optimizer and a :class:`~lightning_accel.scheduler.DeepSpeedSchedulerWrapper` of the
engine's scheduler; the engine steps both inside ``accelerator.backward``.

``HfDeepSpeedConfig`` (a queryable DeepSpeed config), ``map_pytorch_optim_to_deepspeed`` (DeepSpeed's CPU optimizer
for a torch one, for ZeRO-Offload) and ``DeepSpeedEngineWrapper`` (backward and step of an engine as Accelerate's loop
does them) keep Accelerate's behaviour. Accelerate's ``DeepSpeedOptimizerWrapper`` and ``DeepSpeedSchedulerWrapper``
wrap the shim's optimizer and scheduler classes, which this layer cannot import; the scheduler one is
:class:`lightning_accel.scheduler.DeepSpeedSchedulerWrapper`.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from torch import optim
from torch.optim import Optimizer

from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.utils.imports import is_bnb_available
from lightning_accel.utils.versions import compare_versions

__all__ = [
    "DeepSpeedEngineWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
]

_ONLY_DEEPSPEED = (
    "{name} is a placeholder for the {what} a DeepSpeed config declares, and only DeepSpeed builds it. Prepare it with"
    " Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)) whose config has an '{section}' section, or"
    " pass a torch {what} instead."
)


class DummyOptim(Optimizer):
    """Stand-in for the optimizer of the DeepSpeed config (``accelerate.utils.DummyOptim``).

    Unlike Accelerate's, it is a ``torch.optim.Optimizer`` over ``params`` (so the model's setup sees its parameter
    groups), but it cannot step: DeepSpeed replaces it by the config's optimizer.

    Args:
        params: Parameters to optimize, or dicts defining parameter groups (given to DeepSpeed as they are).
        lr: Learning rate; fills ``optimizer.params.lr: "auto"`` (and the scheduler's ``warmup_max_lr``).
        weight_decay: Fills ``optimizer.params.weight_decay: "auto"``.
        **kwargs: Other arguments, kept in :attr:`kwargs` (unused, as in Accelerate).

    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = list(params)  # as given: torch fills its group dicts with defaults, DeepSpeed must not see them
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        groups = [dict(group) if isinstance(group, dict) else group for group in self.params]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Refuse: the config's optimizer, built by DeepSpeed, steps instead.

        Raises:
            RuntimeError: Always (the dummy reached a step without DeepSpeed).

        """
        raise RuntimeError(_ONLY_DEEPSPEED.format(name="DummyOptim", what="optimizer", section="optimizer"))


class DummyScheduler:
    """Stand-in for the scheduler of the DeepSpeed config (``accelerate.utils.DummyScheduler``).

    Args:
        optimizer: The (dummy) optimizer it schedules; its ``lr`` fills ``scheduler.params.warmup_max_lr: "auto"``.
        total_num_steps: Fills ``scheduler.params.total_num_steps: "auto"`` (divided by the processes unless
            batches are split, as in Accelerate).
        warmup_num_steps: Fills ``scheduler.params.warmup_num_steps: "auto"`` (at least 1).
        lr_scheduler_callable: Builds the scheduler from DeepSpeed's optimizer, instead of the config's section.
        **kwargs: Other arguments, kept in :attr:`kwargs` (unused, as in Accelerate).

    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def only_deepspeed_error(scheduler: bool = False) -> ValueError:
    """The error for a dummy prepared without DeepSpeed."""
    if scheduler:
        return ValueError(_ONLY_DEEPSPEED.format(name="DummyScheduler", what="scheduler", section="scheduler"))
    return ValueError(_ONLY_DEEPSPEED.format(name="DummyOptim", what="optimizer", section="optimizer"))


def get_active_deepspeed_plugin(state: Any) -> DeepSpeedPlugin:
    """The DeepSpeed plugin a run uses, read from its state (``AcceleratorState()``).

    The state holds it as Accelerate's does: ``state.deepspeed_plugins`` is one plugin, or a dict of named plugins of
    which the ``selected`` one is active.

    Raises:
        ValueError: If the state's run does not use DeepSpeed, or records no (or no selected) plugin.

    """
    if state.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError(
            f"There is no active DeepSpeedPlugin: the run is {state.distributed_type}, not DEEPSPEED; create the "
            "Accelerator with deepspeed_plugin=DeepSpeedPlugin(...) (or launch with a DeepSpeed config) first"
        )
    plugins = getattr(state, "deepspeed_plugins", None)
    if isinstance(plugins, dict):
        selected = [plugin for plugin in plugins.values() if getattr(plugin, "selected", False)]
        if not selected:
            raise ValueError(
                f"None of the DeepSpeed plugins {sorted(plugins)} is selected; select one with "
                "AcceleratorState().select_deepspeed_plugin(name)"
            )
        return selected[0]
    if plugins is None:
        raise ValueError(
            "The state runs DeepSpeed but records no plugin (state.deepspeed_plugins is unset); the Accelerator "
            "that set up DeepSpeed must store its DeepSpeedPlugin there"
        )
    return plugins


def _bnb_32bit(optimizer: Any, classes: tuple[type, ...]) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' ``classes`` running with 32-bit state."""
    if not isinstance(optimizer, classes):
        return False
    bits = getattr(optimizer, "optim_bits", None)
    return (bits if bits is not None else getattr(optimizer, "args").optim_bits) == 32  # noqa: B009


def map_pytorch_optim_to_deepspeed(optimizer: Optimizer) -> Any:
    """DeepSpeed's CPU optimizer over ``optimizer``'s parameter groups, for ZeRO-Offload (Accelerate's mapping).

    ``DeepSpeedCPUAdam`` by default, in AdamW mode for ``torch.optim.AdamW`` (and bitsandbytes' 32-bit AdamW);
    ``DeepSpeedCPUAdagrad`` for ``torch.optim.Adagrad`` (and bitsandbytes' 32-bit Adagrad); ``DeepSpeedCPULion`` for
    bitsandbytes' 32-bit Lion. Only ``lr`` and ``weight_decay`` are taken from the optimizer's defaults.

    Raises:
        ImportError: Without DeepSpeed.

    """
    defaults: dict[str, Any] = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer_class: Any = DeepSpeedCPUAdam
    if compare_versions("deepspeed", ">=", "0.3.1"):
        adamw = isinstance(optimizer, optim.AdamW)
        if is_bnb_available() and not adamw:
            import bitsandbytes.optim as bnb_optim

            adamw = _bnb_32bit(optimizer, (bnb_optim.AdamW, bnb_optim.AdamW32bit))
        defaults["adamw_mode"] = adamw
    if compare_versions("deepspeed", ">=", "0.5.5"):
        adagrad = isinstance(optimizer, optim.Adagrad)
        if is_bnb_available() and not adagrad:
            import bitsandbytes.optim as bnb_optim

            adagrad = _bnb_32bit(optimizer, (bnb_optim.Adagrad, bnb_optim.Adagrad32bit))
        if adagrad:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

            optimizer_class = DeepSpeedCPUAdagrad
    if is_bnb_available(min_version="0.38.0") and compare_versions("deepspeed", ">=", "0.11.0"):
        from bitsandbytes.optim import Lion, Lion32bit

        if _bnb_32bit(optimizer, (Lion, Lion32bit)):
            from deepspeed.ops.lion import DeepSpeedCPULion

            optimizer_class = DeepSpeedCPULion
    return optimizer_class(optimizer.param_groups, **defaults)


class HfDeepSpeedConfig:
    """A DeepSpeed config that answers questions about itself (ZeRO stage, offload, any dotted key).

    ``transformers`` subclasses it (its own ``HfDeepSpeedConfig``) and keeps a weak reference to the instance, so
    ``from_pretrained`` can see that ZeRO-3 is on: keep the object alive while the model is created.

    Args:
        config_file_or_dict: A dict (copied, not changed), the path of a JSON file, or a JSON string, plain or
            base64-encoded (URL-safe).

    Raises:
        ValueError: If a string is neither an existing file nor (base64) JSON.

    """

    def __init__(self, config_file_or_dict: dict[str, Any] | str | os.PathLike[str]) -> None:
        if isinstance(config_file_or_dict, dict):
            config = copy.deepcopy(config_file_or_dict)
        elif os.path.exists(config_file_or_dict):
            with open(config_file_or_dict, encoding="utf-8") as file:
                config = json.load(file)
        else:
            try:
                try:
                    config = json.loads(config_file_or_dict)  # type: ignore[arg-type]
                except json.JSONDecodeError:
                    config = json.loads(base64.urlsafe_b64decode(config_file_or_dict).decode("utf-8"))  # type: ignore[arg-type]
            except (UnicodeDecodeError, AttributeError, ValueError, TypeError, binascii.Error):
                raise ValueError(
                    "Expected a string path to an existing deepspeed config, or a dictionary, or a base64 encoded "
                    f"string. Received: {config_file_or_dict}"
                ) from None
        self.config: dict[str, Any] = config
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        """Read the ZeRO stage (``-1`` when unset) and whether parameters or optimizer states go to CPU or NVMe."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        self._offload = False
        if self.is_zero2() or self.is_zero3():
            devices = {
                self.get_value("zero_optimization.offload_optimizer.device"),
                self.get_value("zero_optimization.offload_param.device"),
            }
            self._offload = bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        """The section holding the dotted key ``ds_key_long`` and its last part (``None``: a section is missing)."""
        config: Any = self.config
        nodes = ds_key_long.split(".")
        ds_key = nodes.pop()
        for node in nodes:
            config = config.get(node)
            if config is None:
                return None, ds_key
        return config, ds_key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at the dotted key ``ds_key_long`` (``"zero_optimization.stage"``), or ``default``."""
        config, ds_key = self.find_config_node(ds_key_long)
        if config is None:
            return default
        return config.get(ds_key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Delete the section or key at ``ds_key_long``.

        Raises:
            ValueError: If it is missing and ``must_exist`` is set.

        """
        config: Any = self.config
        parent: Any = None
        node = ""
        for node in ds_key_long.split("."):
            parent = config
            config = config.get(node)
            if config is None:
                if must_exist:
                    raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
                return
        if parent is not None:
            parent.pop(node)

    def is_true(self, ds_key_long: str) -> bool:
        """Whether the key is set to a true value (``False`` when it is unset)."""
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """Whether the key is set to a false value (``False`` when it is unset)."""
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        """Whether ZeRO stage 2 is configured."""
        return bool(self._stage == 2)

    def is_zero3(self) -> bool:
        """Whether ZeRO stage 3 is configured."""
        return bool(self._stage == 3)

    def is_offload(self) -> bool:
        """Whether ZeRO-2/3 offloads parameters or optimizer states to CPU or NVMe."""
        return self._offload


class DeepSpeedEngineWrapper:
    """Backward and step of a ``deepspeed.DeepSpeedEngine`` as Accelerate's ``accelerator.backward`` does them.

    Args:
        engine: The DeepSpeed engine.

    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> None:
        """Backward through the engine; at an accumulation boundary (``sync_gradients``) also its step.

        The engine's step clips, steps the optimizer (and its scheduler, if it has one) and zeroes the gradients.
        ``kwargs`` go to ``engine.backward``.
        """
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def get_global_grad_norm(self) -> Any:
        """The engine's global gradient norm of its last step, as a Python number when it is a tensor."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm
