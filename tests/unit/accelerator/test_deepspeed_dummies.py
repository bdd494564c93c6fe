"""``DummyOptim`` / ``DummyScheduler``: the DeepSpeed config's optimizer and scheduler, as in Accelerate 1.15.

The reference for the filled config is HF accelerate's own ``DeepSpeedPlugin.deepspeed_config_process`` fed what
``Accelerator._prepare_deepspeed`` derives from HF's dummies (HF accelerate runs DeepSpeed on CPU only with
``transformers``, which the test environment lacks; a one-off manual run of the training test's script under HF
accelerate 1.15 gave the same learning rates and weights).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel.strategies.deepspeed_core import fill_engine_autos
from lightning_accel.strategies.deepspeed_prepare import (
    PrepareFacts,
    check_dummies,
    dummy_fills,
    resolve_prepare_config,
)
from lightning_accel.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
from tests.helpers import clean_env, free_port

pytest.importorskip("accelerate")

_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
_WARMUP = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "warmup_type": "linear"}
_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 1},
    "optimizer": _OPTIMIZER,
    "scheduler": {"type": "WarmupLR", "params": _WARMUP},
}
_DECAY_CONFIG = {**_CONFIG, "scheduler": {"type": "WarmupDecayLR", "params": {**_WARMUP, "total_num_steps": "auto"}}}
# name -> (config, processes, split_batches, DummyOptim lr, weight decay, total_num_steps, warmup_num_steps)
CASES: dict[str, tuple[dict[str, Any], int, bool, float, float, int | None, int]] = {
    "warmup_one_process": (_CONFIG, 1, False, 0.01, 0.1, None, 4),
    "warmup_zero_is_one": (_CONFIG, 1, False, 0.001, 0.0, None, 0),
    "decay_two_processes": (_DECAY_CONFIG, 2, False, 0.02, 0.01, 101, 10),
    "decay_split_batches": (_DECAY_CONFIG, 2, True, 0.02, 0.01, 101, 10),
    "concrete_values_kept": (
        {**_CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": "auto"}}},
        1,
        False,
        0.01,
        0.2,
        None,
        3,
    ),
}


@pytest.fixture(autouse=True)
def _clean_environment() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    yield
    os.environ.clear()  # DeepSpeed's setup leaves RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK behind
    os.environ.update(saved)


def _hf_config(
    config: dict[str, Any], world_size: int, split: bool, lr: float, wd: float, total: int | None, warmup: int
) -> dict[str, Any]:
    """The dummy-derived entries of HF accelerate 1.15's ``_prepare_deepspeed``, processed by HF's own plugin."""
    from accelerate.utils import DeepSpeedPlugin as HFDeepSpeedPlugin
    from accelerate.utils import DummyOptim as HFDummyOptim
    from accelerate.utils import DummyScheduler as HFDummyScheduler

    plugin = HFDeepSpeedPlugin(hf_ds_config=copy.deepcopy(config))
    optimizer = HFDummyOptim([torch.zeros(1)], lr=lr, weight_decay=wd)
    scheduler = HFDummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=warmup)
    micro = 4 // world_size if split else 4  # the loader's batch size, as in the prepare call
    kwargs: dict[str, Any] = {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": wd}
    kwargs |= {"train_micro_batch_size_per_gpu": micro, "train_batch_size": micro * world_size}
    kwargs |= {"gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    kwargs |= {
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": getattr(scheduler.optimizer, "lr", None),
        "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
    }
    if total is not None:
        kwargs["scheduler.params.total_num_steps"] = total if split else math.ceil(total / world_size)
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    return dict(plugin.deepspeed_config)


@pytest.mark.parametrize("case", list(CASES))
def test_dummies_fill_the_config_as_accelerate(case: str) -> None:
    config, world_size, split, lr, wd, total, warmup = CASES[case]
    optimizer = DummyOptim([torch.zeros(1, requires_grad=True)], lr=lr, weight_decay=wd)
    scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=warmup)
    check_dummies(config, optimizer, scheduler)
    fills = dummy_fills(optimizer, scheduler, world_size, split)
    facts = PrepareFacts(world_size, "cpu", batch_sizes=(4,), split_batches=split, dummy_fills=tuple(fills.items()))
    ours = fill_engine_autos(resolve_prepare_config(DeepSpeedPlugin(hf_ds_config=config).deepspeed_config, facts))
    expected = _hf_config(config, world_size, split, lr, wd, total, warmup)
    for section in ("optimizer", "scheduler"):
        assert ours[section] == expected[section]
    assert "zero_allow_untested_optimizer" not in ours  # no torch optimizer in the call


def test_dummy_optim_gives_deepspeed_the_groups_as_written() -> None:
    weight = torch.zeros(2, requires_grad=True)
    dummy = DummyOptim([{"params": [weight], "weight_decay": 0.5}], lr=0.1)
    assert dummy.params == [{"params": [weight], "weight_decay": 0.5}]  # no lr: the config's applies, as in HF
    assert (dummy.lr, dummy.weight_decay, dummy.param_groups[0]["lr"]) == (0.1, 0, 0.1)


def test_mismatches_raise_accelerates_errors() -> None:
    params = [torch.zeros(1, requires_grad=True)]
    dummy, torch_opt = DummyOptim(params), torch.optim.SGD(params, lr=0.1)
    torch_sched = torch.optim.lr_scheduler.StepLR(torch_opt, 1)
    no_sections = {"zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match="DummyOptim was prepared, but the DeepSpeed config has no 'optimizer'"):
        check_dummies(no_sections, dummy, None)
    with pytest.raises(ValueError, match="declares an 'optimizer' and the code prepares a torch optimizer"):
        check_dummies(_CONFIG, torch_opt, None)
    with pytest.raises(ValueError, match="declares a 'scheduler' and the code prepares a torch scheduler"):
        check_dummies(_CONFIG, dummy, torch_sched)
    with pytest.raises(ValueError, match="no 'scheduler' section and no lr_scheduler_callable"):
        check_dummies({**no_sections, "optimizer": _OPTIMIZER}, dummy, DummyScheduler(dummy))
    with pytest.raises(ValueError, match="only DummyScheduler can schedule it"):
        check_dummies({**no_sections, "optimizer": _OPTIMIZER}, dummy, torch_sched)
    check_dummies({**no_sections, "optimizer": _OPTIMIZER}, dummy, DummyScheduler(dummy, lr_scheduler_callable=len))


def test_dummies_without_deepspeed_are_refused() -> None:
    net = nn.Linear(2, 1)
    accelerator = Accelerator(cpu=True)
    _, optimizer = accelerator.prepare(net, DummyOptim(net.parameters()))
    with pytest.raises(RuntimeError, match="DummyOptim is a placeholder for the optimizer a DeepSpeed config"):
        optimizer.step()
    with pytest.raises(ValueError, match="DummyScheduler is a placeholder for the scheduler a DeepSpeed config"):
        accelerator.prepare(DummyScheduler(optimizer))


@pytest.mark.usefixtures("undo_library_side_effects", "process_wide_group")
def test_config_optimizer_and_warmup_train_one_process() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(_CONFIG)))
    x = torch.randn(16, 4)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    dummy = DummyOptim(net.parameters(), lr=0.01, weight_decay=0.1)
    model, optimizer, scheduler, loader = accelerator.prepare(
        net, dummy, DummyScheduler(dummy, warmup_num_steps=4), loader
    )
    assert type(scheduler).__name__ == "DeepSpeedSchedulerWrapper"
    assert optimizer.param_groups[0]["weight_decay"] == 0.1  # the config's AdamW, built by DeepSpeed
    before = [p.detach().clone() for p in model.parameters()]
    lrs = []
    for inputs, targets in loader:
        accelerator.backward(nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()  # no-ops: the engine stepped both in backward
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == pytest.approx([0.0, 0.0025, 0.005, 0.0075])  # linear warmup to 0.01 over 4 steps, as in HF
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match=r"not supported under DeepSpeed.*gradient_clipping"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)
