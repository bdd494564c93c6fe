"""Accelerate 1.15's rules for the ``"auto"`` entries of a DeepSpeed config, used by ``Accelerator.prepare``.

The Trainer and plain Fabric reconcile the config with their own loop (:func:`~.deepspeed_core.resolve_config`:
``"auto"`` clipping follows ``Trainer(gradient_clip_val=...)``, default none). A script migrated from Accelerate expects
what ``accelerate.Accelerator._prepare_deepspeed`` and ``DeepSpeedPlugin.set_mixed_precision`` do instead, so
:func:`resolve_prepare_config` fills the config that way for ``lightning_accel.Accelerator``:

- ``gradient_clipping``: ``"auto"`` (the default of ``DeepSpeedPlugin()``) becomes ``1.0``. An absent entry stays
  absent, which is DeepSpeed's own default (1.0 in DeepSpeed 0.19), so ``DeepSpeedPlugin(gradient_clipping=0)``, which
  leaves the entry out, clips at 1.0 too, as in Accelerate; ``"gradient_clipping": 0`` in the config turns it off.
- ``train_micro_batch_size_per_gpu``: ``"auto"`` becomes the batch size of the data loaders in the same ``prepare``
  call (the smallest, or the largest with ``is_train_batch_min=False``; divided by the processes with
  ``split_batches``); ``train_batch_size``: ``"auto"`` becomes micro-batch size x accumulation x processes.
- ``gradient_accumulation_steps``: ``"auto"`` becomes the ``Accelerator``'s.
- ``zero_optimization.stage3_gather_16bit_weights_on_model_save``: ``"auto"`` becomes ``False``.
- ``fp16`` / ``bf16``: the section of the mixed precision is added when missing (``fp16`` with ``auto_cast``), the
  other one is added disabled, ``"auto"`` in ``enabled`` follows the mixed precision.
- ``zero_allow_untested_optimizer``: ``True`` when the call holds a torch optimizer.
- ``optimizer.params.lr`` / ``weight_decay``: ``"auto"`` becomes the ``DummyOptim``'s; ``scheduler.params``'s
  ``warmup_min_lr`` / ``warmup_max_lr`` / ``warmup_num_steps`` / ``total_num_steps``: ``"auto"`` becomes ``0``, the
  optimizer's ``lr``, the ``DummyScheduler``'s warmup (at least 1) and total steps (per process unless
  ``split_batches``) (:func:`dummy_fills`; :func:`check_dummies` raises Accelerate's errors for a mismatch between
  the call's optimizer/scheduler and the config's sections).

Hidden-size bucket sizes and optimizer values are filled afterwards, when the engine is built
(:func:`~.deepspeed_core.fill_engine_autos`). Differences from Accelerate, each where Accelerate fails or is silent:
without a data loader (or one without an integer batch size) an ``"auto"`` micro-batch size becomes ``1`` (Accelerate
raises); a precision section that contradicts the mixed precision raises (Accelerate trains in the config's dtype
when ``mixed_precision="no"``); CPU offload on CPU devices keeps the torch optimizer (see :func:`resolve_config`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accel.strategies.deepspeed_core import keep_torch_optimizer_on_cpu, resolve_precision
from lightning_accel.utils.deepspeed import DummyOptim, DummyScheduler

__all__ = ["PrepareFacts", "check_dummies", "dummy_fills", "resolve_prepare_config"]

# What Accelerate 1.15 fills in any "auto" entry when it prepares a DeepSpeed engine (dotted keys).
_ACCELERATE_DEFAULTS: dict[str, Any] = {
    "gradient_clipping": 1.0,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}
_MIXED_PRECISION = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp8": "bf16"}
# The section Accelerate adds for the mixed precision when the config has none.
_ENABLED_SECTION: dict[str, dict[str, Any]] = {"fp16": {"enabled": True, "auto_cast": True}, "bf16": {"enabled": True}}


@dataclass(frozen=True)
class PrepareFacts:
    """What an ``Accelerator.prepare`` call that builds a DeepSpeed engine states about the run.

    Attributes:
        world_size: Number of data-parallel processes.
        device_type: ``"cpu"`` or ``"cuda"``.
        accumulation: The ``Accelerator``'s gradient accumulation steps.
        precision: Lightning's precision string of the run (``"32-true"``, ``"bf16-mixed"``, ...), or ``"fp8"``.
        batch_sizes: Batch sizes of the data loaders passed in the same call (``None`` where unknown).
        split_batches: ``DataLoaderConfiguration(split_batches=True)``: the loaders' batches are split over the
            processes.
        torch_optimizer: Whether the call holds a torch optimizer.
        dummy_fills: ``"auto"`` entries (dotted keys) filled from the call's ``DummyOptim`` / ``DummyScheduler``
            (:func:`dummy_fills`).

    """

    world_size: int
    device_type: str
    accumulation: int = 1
    precision: str = "32-true"
    batch_sizes: tuple[int | None, ...] = ()
    split_batches: bool = False
    torch_optimizer: bool = False
    dummy_fills: tuple[tuple[str, Any], ...] = ()


def resolve_prepare_config(
    config: Mapping[str, Any], facts: PrepareFacts, *, is_train_batch_min: bool = True
) -> dict[str, Any]:
    """Fill the run-dependent ``"auto"`` entries of ``config`` as Accelerate 1.15's ``prepare`` does.

    Args:
        config: The plugin's DeepSpeed config (not modified).
        facts: What the ``prepare`` call states.
        is_train_batch_min: ``DeepSpeedPlugin.is_train_batch_min``: with several loaders, the smallest batch size is
            the micro-batch size (else the largest).

    Returns:
        A new config; concrete entries are kept as they are.

    Raises:
        ValueError: If a precision section contradicts the mixed precision, or ``train_batch_size`` is not the
            product of micro-batch size, accumulation and processes.

    """
    resolved = copy.deepcopy(dict(config))
    fills = dict(_ACCELERATE_DEFAULTS) | dict(facts.dummy_fills)
    if resolved.get("gradient_accumulation_steps") == "auto":
        resolved["gradient_accumulation_steps"] = facts.accumulation
    micro = resolved.get("train_micro_batch_size_per_gpu")
    if micro == "auto":
        micro = _micro_batch_size(facts, is_train_batch_min)
    if micro is not None:
        fills["train_micro_batch_size_per_gpu"] = micro
        fills["train_batch_size"] = micro * resolved.get("gradient_accumulation_steps", 1) * facts.world_size
    _fill_autos(resolved, fills)
    _check_train_batch_size(resolved, facts.world_size)
    _add_precision_sections(resolved, facts.precision)
    resolve_precision(resolved, facts.precision)
    if facts.torch_optimizer:
        resolved["zero_allow_untested_optimizer"] = True
    keep_torch_optimizer_on_cpu(resolved, facts.device_type)
    return resolved


def check_dummies(config: Mapping[str, Any], optimizer: Any, scheduler: Any) -> None:
    """Raise Accelerate 1.15's errors where the call's optimizer or scheduler does not match the config's sections.

    Args:
        config: The plugin's DeepSpeed config.
        optimizer: The call's optimizer (torch or ``DummyOptim``), or ``None``.
        scheduler: The call's scheduler (torch or ``DummyScheduler``), or ``None``.

    Raises:
        ValueError: A torch optimizer (scheduler) with an ``"optimizer"`` (``"scheduler"``) section, a ``DummyOptim``
            without one, a ``DummyScheduler`` without one nor ``lr_scheduler_callable``, or a ``DummyOptim`` with a
            torch scheduler.

    """
    dummy_opt, dummy_sched = isinstance(optimizer, DummyOptim), isinstance(scheduler, DummyScheduler)
    if optimizer is not None and ("optimizer" in config) != dummy_opt:
        raise ValueError(_MISMATCH["optimizer", dummy_opt])
    if scheduler is not None and "scheduler" in config and not dummy_sched:
        raise ValueError(_MISMATCH["scheduler", False])
    if dummy_sched and "scheduler" not in config and scheduler.lr_scheduler_callable is None:
        raise ValueError(_MISMATCH["scheduler", True])
    if scheduler is not None and dummy_opt and not dummy_sched:
        raise ValueError(
            f"DummyOptim was prepared with a torch scheduler ({type(scheduler).__name__}); only DummyScheduler can"
            " schedule it, as in Accelerate: use DummyScheduler (with a 'scheduler' section in the DeepSpeed config,"
            " or lr_scheduler_callable)."
        )


_MISMATCH = {
    ("optimizer", False): "The DeepSpeed config declares an 'optimizer' and the code prepares a torch optimizer too."
    " Remove the config's 'optimizer' section, or prepare lightning_accel.utils.DummyOptim(params, lr=...) instead.",
    ("optimizer", True): "DummyOptim was prepared, but the DeepSpeed config has no 'optimizer' section to build."
    " Add one (e.g. {'type': 'AdamW', 'params': {'lr': 'auto', 'weight_decay': 'auto'}}) or prepare a torch optimizer.",
    ("scheduler", False): "The DeepSpeed config declares a 'scheduler' and the code prepares a torch scheduler too."
    " Remove the config's 'scheduler' section, or prepare lightning_accel.utils.DummyScheduler(optimizer, ...).",
    ("scheduler", True): "DummyScheduler was prepared, but the DeepSpeed config has no 'scheduler' section and no"
    " lr_scheduler_callable was given. Add a 'scheduler' section (e.g. WarmupLR) or pass lr_scheduler_callable.",
}


def dummy_fills(optimizer: Any, scheduler: Any, world_size: int, split_batches: bool) -> dict[str, Any]:
    """The ``"auto"`` values Accelerate 1.15 takes from a ``DummyOptim`` / ``DummyScheduler`` (dotted keys).

    Args:
        optimizer: The call's optimizer (torch or ``DummyOptim``), or ``None``.
        scheduler: The call's scheduler, or ``None``; only a ``DummyScheduler`` without ``lr_scheduler_callable``
            fills entries.
        world_size: Number of processes (``total_num_steps`` is per process unless ``split_batches``).
        split_batches: ``DataLoaderConfiguration(split_batches=True)``.

    Returns:
        The entries to fill where the config has ``"auto"``.

    """
    fills: dict[str, Any] = {}
    if isinstance(optimizer, DummyOptim):
        fills |= {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
    if not isinstance(scheduler, DummyScheduler) or scheduler.lr_scheduler_callable is not None:
        return fills
    defaults = getattr(scheduler.optimizer, "defaults", None)
    max_lr = getattr(scheduler.optimizer, "lr", None) if defaults is None else defaults["lr"]
    fills |= {
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": max_lr,
        "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
    }
    if scheduler.total_num_steps is not None:
        total = scheduler.total_num_steps
        fills["scheduler.params.total_num_steps"] = total if split_batches else math.ceil(total / world_size)
    return fills


def _micro_batch_size(facts: PrepareFacts, is_train_batch_min: bool) -> int:
    sizes = [size for size in facts.batch_sizes if size is not None]
    if not sizes:
        return 1  # DeepSpeed only counts samples with it (Accelerate raises here)
    if facts.split_batches:
        sizes = [size // facts.world_size for size in sizes]
    return min(sizes) if is_train_batch_min else max(sizes)


def _fill_autos(config: dict[str, Any], fills: Mapping[str, Any], prefix: str = "") -> None:
    """Replace each ``"auto"`` leaf whose dotted key is in ``fills`` (Accelerate's ``deepspeed_config_process``)."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _fill_autos(value, fills, f"{dotted}.")
        elif isinstance(value, str) and value == "auto" and dotted in fills:
            config[key] = fills[dotted]


def _check_train_batch_size(config: Mapping[str, Any], world_size: int) -> None:
    total, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if not all(isinstance(v, int) for v in (total, micro, accumulation)):
        return
    if total != micro * accumulation * world_size:
        raise ValueError(
            f"DeepSpeed config has train_batch_size={total!r}, but micro-batch size {micro} x accumulation"
            f" {accumulation} x {world_size} processes = {micro * accumulation * world_size}. Set train_batch_size"
            " to 'auto' (or remove it), or change the batch size or accumulation so that they multiply to it."
        )


def _add_precision_sections(config: dict[str, Any], precision: str) -> None:
    """Accelerate's sections: the mixed precision's one enabled when missing, the others disabled when missing."""
    wanted = _MIXED_PRECISION.get(precision)
    for section in ("fp16", "bf16"):
        if section in config or (section == "bf16" and "bfloat16" in config):
            continue
        config[section] = dict(_ENABLED_SECTION[section]) if section == wanted else {"enabled": False}
