"""Mirror of ``accelerate.utils.deepspeed``: DeepSpeed's optimizer/scheduler placeholders, active plugin.

With ``"optimizer"`` / ``"scheduler"`` sections in the DeepSpeed config, an Accelerate script passes
``DummyOptim(params, lr=..., weight_decay=...)`` and ``DummyScheduler(optimizer, total_num_steps=...,
warmup_num_steps=...)`` to ``accelerator.prepare``; DeepSpeed builds the real ones from the config, with its
``"auto"`` entries filled from the dummies' arguments (see :mod:`lightning_accel._shim.deepspeed_prepare`).
Prepare returns the engine's optimizer and a :class:`~lightning_accel.scheduler.DeepSpeedSchedulerWrapper` of the
engine's scheduler; the engine steps both inside ``accelerator.backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.optim import Optimizer

from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.enums import DistributedType

__all__ = ["DummyOptim", "DummyScheduler", "get_active_deepspeed_plugin"]

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
