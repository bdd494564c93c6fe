"""Accelerate 1.15's rules for the "auto" entries of a DeepSpeed config in ``lightning_accel.Accelerator``.

HF accelerate runs DeepSpeed on one CPU process only with ``transformers`` installed, which the test environment lacks.
The reference here is therefore HF accelerate's own ``DeepSpeedPlugin`` processing (``set_mixed_precision``,
``fill_match``, ``deepspeed_config_process``) fed what ``Accelerator._prepare_deepspeed`` feeds it in 1.15. Engine
runs on 2 processes (weights against DDP, the config the engine got) are in
``tests/unit/checkpoint/test_accelerator_sharded_ckpt.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_accel.strategies.deepspeed_core import fill_engine_autos, optimizer_hparams, resolve_config
from lightning_accel.strategies.deepspeed_prepare import PrepareFacts, resolve_prepare_config
from lightning_accel.utils import DeepSpeedPlugin

pytest.importorskip("accelerate")

PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp8": "fp8"}
_FILE_WITH_AUTOS = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
}
_FILE_CONCRETE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
# name -> (DeepSpeedPlugin fields, mixed precision, accumulation, loader batch sizes, processes, split_batches, hidden)
CASES: dict[str, tuple[dict[str, Any], str, int, tuple[int, ...], int, bool, int | None]] = {
    "default_plugin": ({"zero_stage": 2}, "no", 1, (4,), 1, False, None),
    "two_processes_accumulating": ({"zero_stage": 3}, "no", 2, (2,), 2, False, None),
    "explicit_clipping_bf16": ({"zero_stage": 1, "gradient_clipping": 0.5}, "bf16", 2, (3,), 2, False, None),
    "clipping_zero_is_deepspeeds_default": ({"zero_stage": 2, "gradient_clipping": 0}, "no", 1, (4,), 1, False, None),
    "fp16_section": ({"zero_stage": 2}, "fp16", 1, (4,), 1, False, None),
    "fp8_runs_bf16": ({"zero_stage": 2}, "fp8", 1, (4,), 1, False, None),
    "file_with_autos": ({"hf_ds_config": _FILE_WITH_AUTOS}, "bf16", 2, (2,), 2, False, 8),
    "file_concrete_micro_batch": ({"hf_ds_config": _FILE_CONCRETE}, "no", 1, (5,), 2, False, None),
    "two_loaders_smallest": ({"zero_stage": 2}, "no", 1, (6, 2), 1, False, None),
    "two_loaders_largest": ({"zero_stage": 2, "is_train_batch_min": False}, "no", 1, (6, 2), 1, False, None),
    "split_batches": ({"zero_stage": 2}, "no", 1, (8,), 2, True, None),
}


@pytest.fixture(autouse=True)
def _no_launcher_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)  # HF accelerate's DeepSpeedPlugin reads them
    yield


def hf_prepared_config(
    fields: dict[str, Any],
    *,
    mixed_precision: str,
    accumulation: int,
    batch_sizes: tuple[int, ...],
    world_size: int,
    split_batches: bool = False,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """The config HF accelerate 1.15 builds its engine with: its plugin, processed as ``_prepare_deepspeed`` does."""
    from accelerate.utils import DeepSpeedPlugin as HFDeepSpeedPlugin

    plugin = HFDeepSpeedPlugin(**copy.deepcopy(fields))
    plugin.set_mixed_precision(mixed_precision)  # AcceleratorState does this
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=accumulation)
    micro = plugin.get_value("train_micro_batch_size_per_gpu")
    if micro == "auto":
        sizes = [size // world_size if split_batches else size for size in batch_sizes]
        micro = min(sizes) if plugin.is_train_batch_min else max(sizes)
    kwargs: dict[str, Any] = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    }
    if micro is not None:
        kwargs["train_micro_batch_size_per_gpu"] = micro
        kwargs["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * world_size
    plugin.deepspeed_config["zero_allow_untested_optimizer"] = True  # a torch optimizer is prepared
    if hidden_size is not None:
        kwargs["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        kwargs["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        kwargs["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    return plugin.deepspeed_config


def our_prepared_config(
    fields: dict[str, Any],
    *,
    mixed_precision: str,
    accumulation: int,
    batch_sizes: tuple[int, ...],
    world_size: int,
    split_batches: bool = False,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """What lightning_accel's Accelerator builds its engine with (prepare's rules, then the model's entries)."""
    plugin = DeepSpeedPlugin(**copy.deepcopy(fields))
    facts = PrepareFacts(
        world_size=world_size,
        device_type="cpu",
        accumulation=accumulation,
        precision=PRECISION[mixed_precision],
        batch_sizes=batch_sizes,
        split_batches=split_batches,
        torch_optimizer=True,
    )
    config = resolve_prepare_config(plugin.deepspeed_config, facts, is_train_batch_min=plugin.is_train_batch_min)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    return fill_engine_autos(config, optimizer_hparams=optimizer_hparams(optimizer), hidden_size=hidden_size)


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_fills_the_config_as_accelerate(case: str) -> None:
    fields, mixed_precision, accumulation, batch_sizes, world_size, split, hidden = CASES[case]
    inputs = {
        "mixed_precision": mixed_precision,
        "accumulation": accumulation,
        "batch_sizes": batch_sizes,
        "world_size": world_size,
        "split_batches": split,
        "hidden_size": hidden,
    }
    assert our_prepared_config(fields, **inputs) == hf_prepared_config(fields, **inputs)


def test_default_plugin_clips_at_one_in_the_accelerator_and_not_in_the_trainer() -> None:
    config = DeepSpeedPlugin().deepspeed_config
    facts = PrepareFacts(world_size=1, device_type="cpu", batch_sizes=(4,))
    assert resolve_prepare_config(config, facts)["gradient_clipping"] == 1.0
    from lightning_accel.strategies.deepspeed_core import TrainingFacts

    assert resolve_config(config, TrainingFacts(world_size=1, device_type="cpu"))["gradient_clipping"] == 0.0


def test_without_a_loader_the_micro_batch_size_is_one() -> None:
    config = resolve_prepare_config(DeepSpeedPlugin().deepspeed_config, PrepareFacts(world_size=2, device_type="cpu"))
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (1, 2)


def test_conflicts_name_both_values() -> None:
    fp16_file = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r"fp16.enabled=True, but the precision is 'bf16-mixed'"):
        resolve_prepare_config(fp16_file.deepspeed_config, PrepareFacts(1, "cpu", precision="bf16-mixed"))
    file = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    sized = DeepSpeedPlugin(hf_ds_config=file)
    with pytest.raises(ValueError, match=r"train_batch_size=16, but micro-batch size 4 x accumulation 1 x 2"):
        resolve_prepare_config(sized.deepspeed_config, PrepareFacts(2, "cpu", batch_sizes=(4,)))
