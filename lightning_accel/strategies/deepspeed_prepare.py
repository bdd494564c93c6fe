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

Hidden-size bucket sizes and optimizer values are filled afterwards, when the engine is built
(:func:`~.deepspeed_core.fill_engine_autos`). Differences from Accelerate, each where Accelerate fails or is silent:
without a data loader (or one without an integer batch size) an ``"auto"`` micro-batch size becomes ``1`` (Accelerate
raises); a precision section that contradicts the mixed precision raises (Accelerate trains in the config's dtype
when ``mixed_precision="no"``); CPU offload on CPU devices keeps the torch optimizer (see :func:`resolve_config`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accel.strategies.deepspeed_core import keep_torch_optimizer_on_cpu, resolve_precision

__all__ = ["PrepareFacts", "resolve_prepare_config"]

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

    """

    world_size: int
    device_type: str
    accumulation: int = 1
    precision: str = "32-true"
    batch_sizes: tuple[int | None, ...] = ()
    split_batches: bool = False
    torch_optimizer: bool = False


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
    fills = dict(_ACCELERATE_DEFAULTS)
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
