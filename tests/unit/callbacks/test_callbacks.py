"""lightning_accel.callbacks in one process (``acc_no``): accumulation windows, sampler order, rotation, kill-safety.

The 2-process composition and exact resume are in ``tests/launch/test_callbacks_distributed.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.callbacks import (
    CheckpointRotation,
    GradientAccumulation,
    SeedableSampler,
    ShardedSeedableSampler,
    complete_checkpoints,
    epoch_order,
    latest_checkpoint,
    plan_micro_batch,
    shard_batches,
)
from lightning_accel.callbacks.rng import collect_rng_states, gather_rng_states, restore_rng_states
from lightning_accel.config import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from tests.helpers import SCRIPTS, clean_env, run_python

NO, STEP = False, True


def plan_steps(num_steps: int, epochs: int, batches: int, *, sync_with_dataloader: bool) -> list[bool]:
    return [
        plan_micro_batch(
            num_steps,
            sync_with_dataloader=sync_with_dataloader,
            batch_idx=b,
            total_batch_idx=e * batches + b,
            epoch_length=batches,
            is_last_batch=b == batches - 1,
        ).steps
        for e in range(epochs)
        for b in range(batches)
    ]


def test_plan_over_5_batches_with_2_steps_is_no_step_no_step_step_each_epoch() -> None:
    assert plan_steps(2, 2, 5, sync_with_dataloader=True) == [NO, STEP, NO, STEP, STEP] * 2


def test_plan_carries_the_window_across_epochs_without_sync_with_dataloader() -> None:
    assert plan_steps(2, 2, 5, sync_with_dataloader=False) == [NO, STEP] * 5


def test_plan_gives_the_true_size_of_a_short_last_window() -> None:
    plans = [
        plan_micro_batch(
            4, sync_with_dataloader=True, batch_idx=b, total_batch_idx=b, epoch_length=7, is_last_batch=b == 6
        )
        for b in range(7)
    ]
    assert [p.window_size for p in plans] == [4, 4, 4, 4, 3, 3, 3]
    assert [p.starts_window for p in plans] == [True, False, False, False, True, False, False]
    assert [p.steps for p in plans] == [False, False, False, True, False, False, True]


def test_plan_without_epoch_length_steps_on_the_last_batch_and_keeps_num_steps() -> None:
    plan = plan_micro_batch(
        4, sync_with_dataloader=True, batch_idx=5, total_batch_idx=5, epoch_length=None, is_last_batch=True
    )
    assert plan.steps and plan.window_size == 4 and not plan.starts_window


class Recorder(L.LightningModule):
    """A linear model that records the batches it sees, the gradients it steps with and when it steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Linear(3, 1)
        self.seen: list[tuple[int, list[int]]] = []
        self.steps: list[tuple[int, int]] = []
        self.step_grads: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append((self.current_epoch, index.tolist()))
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.append((self.current_epoch, self.trainer.fit_loop.batch_idx))
        self.step_grads.append(self.net.weight.grad.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def samples(n: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))


def fit(callbacks: list[Any], *, shuffle: bool = False, batch_size: int = 2, **trainer_kwargs: Any) -> Recorder:
    module = Recorder()
    trainer_kwargs.setdefault("max_epochs", 2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(cb, CheckpointRotation) for cb in callbacks),
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(samples(), batch_size=batch_size, shuffle=shuffle))
    return module


@pytest.mark.parametrize(
    ("sync_with_dataloader", "expected"),
    [(True, [(0, 1), (0, 3), (0, 4), (1, 1), (1, 3), (1, 4)]), (False, [(0, 1), (0, 3), (1, 0), (1, 2), (1, 4)])],
)
def test_trainer_steps_in_accelerates_pattern(sync_with_dataloader: bool, expected: list[tuple[int, int]]) -> None:
    module = fit([GradientAccumulation(2, sync_with_dataloader=sync_with_dataloader)])
    assert module.steps == expected


def test_short_last_window_is_divided_by_its_true_size_like_a_plain_pytorch_loop() -> None:
    module = fit([GradientAccumulation(2)], max_epochs=1)

    reference = Recorder()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y, _ = samples().tensors
    expected_grads = []
    for window in ([0, 1], [2, 3], [4]):
        optimizer.zero_grad()
        for b in window:
            loss = nn.functional.mse_loss(reference.net(x[2 * b : 2 * b + 2]), y[2 * b : 2 * b + 2])
            (loss / len(window)).backward()
        expected_grads.append(reference.net.weight.grad.detach().clone())
        optimizer.step()

    assert len(module.step_grads) == 3
    for got, expected in zip(module.step_grads, expected_grads, strict=True):
        assert torch.equal(got, expected)
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_lightnings_own_accumulation_halves_the_last_window_of_one_batch() -> None:
    ours = fit([GradientAccumulation(2)], max_epochs=1)
    lightning = fit([], max_epochs=1, accumulate_grad_batches=2)
    # The first windows agree; on the window of one batch Lightning divides by 2.
    assert torch.equal(ours.step_grads[0], lightning.step_grads[0])
    torch.testing.assert_close(ours.step_grads[2], 2 * lightning.step_grads[2])


def test_accumulation_leaves_the_trainer_as_it_found_it() -> None:
    module = Recorder()
    callback = GradientAccumulation(2, sync_each_batch=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.fit(module, DataLoader(samples(), batch_size=2))
    assert trainer.accumulate_grad_batches == 1
    assert "_should_accumulate" not in vars(trainer.fit_loop.epoch_loop)
    assert "_make_zero_grad_fn" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)
    assert "block_backward_sync" not in vars(trainer.strategy)


def test_callbacks_undo_their_patches_when_fit_raises() -> None:
    class Crashes(Recorder):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        logger=False,
        enable_checkpointing=False,
        callbacks=[GradientAccumulation(2), SeedableSampler(0)],
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Crashes(), DataLoader(samples(), batch_size=2, shuffle=True))
    assert trainer.accumulate_grad_batches == 1
    assert "_should_accumulate" not in vars(trainer.fit_loop.epoch_loop)
    assert "process_dataloader" not in vars(trainer.strategy)


def test_accumulation_refuses_a_second_accumulation_setting_and_manual_optimization() -> None:
    with pytest.raises(ValueError, match="remove `accumulate_grad_batches`"):
        fit([GradientAccumulation(2)], accumulate_grad_batches=3)

    class Manual(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        logger=False,
        enable_checkpointing=False,
        callbacks=[GradientAccumulation(2)],
    )
    with pytest.raises(ValueError, match="automatic_optimization is False"):
        trainer.fit(Manual(), DataLoader(samples(), batch_size=2))


def test_accumulation_from_plugin() -> None:
    plugin = GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False, sync_each_batch=True)
    callback = GradientAccumulation.from_plugin(plugin)
    assert (callback.num_steps, callback.sync_with_dataloader, callback.sync_each_batch) == (4, False, True)
    with pytest.raises(ValueError, match="num_steps=N"):
        GradientAccumulation.from_plugin(GradientAccumulationPlugin())


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    ("num_samples", "batch_size", "num_processes"),
    [(10, 3, 2), (7, 3, 2), (9, 3, 2), (2, 3, 2), (38, 4, 2), (23, 2, 3), (11, 4, 1)],
)
def test_shard_batches_deals_like_accelerates_batch_sampler_shard(
    num_samples: int, batch_size: int, num_processes: int, drop_last: bool
) -> None:
    accelerate = pytest.importorskip("accelerate.data_loader")
    order = epoch_order(num_samples, data_seed=3, epoch=1)
    batches = torch.utils.data.BatchSampler(order, batch_size, drop_last=drop_last)
    for rank in range(num_processes):
        if num_processes == 1:  # Accelerate does not shard for one process
            expected = list(batches)
        else:
            expected = list(accelerate.BatchSamplerShard(batches, num_processes=num_processes, process_index=rank))
        assert shard_batches(order, batch_size, num_processes, rank, drop_last) == expected
        sampler = ShardedSeedableSampler(
            num_samples,
            batch_size=batch_size,
            drop_last=drop_last,
            num_processes=num_processes,
            process_index=rank,
            data_seed=3,
            epoch=1,
        )
        assert list(sampler) == [i for batch in expected for i in batch]
        assert len(sampler) == sum(len(batch) for batch in expected)


def test_epoch_order_is_accelerates_seedable_random_sampler() -> None:
    accelerate = pytest.importorskip("accelerate.data_loader")
    sampler = accelerate.SeedableRandomSampler(range(20), data_seed=11)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert epoch_order(20, 11, epoch) == list(sampler)


def test_sampler_skips_consumed_batches_once_then_starts_epochs_from_the_beginning() -> None:
    sampler = ShardedSeedableSampler(
        10, batch_size=2, drop_last=False, num_processes=1, process_index=0, data_seed=0, epoch=2, skip_batches=3
    )
    order = epoch_order(10, 0, 2)
    assert list(sampler) == order[6:]
    assert list(sampler) == order
    sampler.set_epoch(3)
    assert list(sampler) == epoch_order(10, 0, 3)


def test_seedable_sampler_orders_each_epoch_by_the_randperm_formula() -> None:
    module = fit([SeedableSampler(data_seed=21)], shuffle=True, max_epochs=3)
    for epoch in range(3):
        seen = [i for e, batch in module.seen if e == epoch for i in batch]
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(21 + epoch)).tolist()
        assert seen == expected
    assert len({tuple(i for e, b in module.seen if e == epoch for i in b) for epoch in range(3)}) == 3


def test_seedable_sampler_leaves_unshuffled_loaders_alone_and_says_so() -> None:
    with pytest.warns(UserWarning, match="SeedableSampler left a training dataloader as it is"):
        module = fit([SeedableSampler(data_seed=21)], shuffle=False, max_epochs=1)
    assert [i for _, batch in module.seen for i in batch] == list(range(10))


def test_seedable_sampler_from_config() -> None:
    assert SeedableSampler.from_config(DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)).data_seed == 5
    with pytest.raises(ValueError, match="even_batches=True"):
        SeedableSampler.from_config(DataLoaderConfiguration(use_seedable_sampler=True, even_batches=False))
    with pytest.raises(ValueError, match="use_seedable_sampler=False"):
        SeedableSampler.from_config(DataLoaderConfiguration())


def rotation(project: Path, **kwargs: Any) -> CheckpointRotation:
    kwargs.setdefault("every_n_train_steps", 1)
    total_limit = kwargs.pop("total_limit", 2)
    config = ProjectConfiguration(project, automatic_checkpoint_naming=True, total_limit=total_limit)
    return CheckpointRotation(config, **kwargs)


def test_four_saves_with_total_limit_2_leave_checkpoint_2_and_3_and_resume_continues(tmp_path: Path) -> None:
    first = rotation(tmp_path)
    fit([first], max_steps=4)
    names = [p.name for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert names == ["checkpoint_2", "checkpoint_3"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoints" / "checkpoint_3")
    assert first.project_config.iteration == 4

    second = rotation(tmp_path)
    module = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="acc_no", max_steps=6, logger=False, callbacks=[second])
    trainer.fit(module, DataLoader(samples(), batch_size=2), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "checkpoints" / "checkpoint_3")
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["checkpoint_4", "checkpoint_5"]
    assert second.project_config.iteration == 6
    assert trainer.checkpoint_callback is second
    assert second.best_model_path == str(tmp_path / "checkpoints" / "checkpoint_5")


def test_checkpoint_every_n_epochs(tmp_path: Path) -> None:
    fit([rotation(tmp_path, every_n_train_steps=None, every_n_epochs=2, total_limit=None)], max_epochs=4)
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["checkpoint_0", "checkpoint_1"]
    checkpoint = torch.load(tmp_path / "checkpoints" / "checkpoint_1", weights_only=True)
    assert checkpoint["epoch"] == 3
    (state,) = (v for k, v in checkpoint["callbacks"].items() if k.startswith("CheckpointRotation"))
    assert state["iteration"] == 2 and len(state["rng_states"]) == 1


class DropoutRecorder(Recorder):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        return super().training_step((nn.functional.dropout(x, 0.5, self.training), y, index), batch_idx)


def fit_three_epochs(
    project: Path, ckpt_path: str | None = None, **trainer_kwargs: Any
) -> tuple[DropoutRecorder, L.Trainer]:
    torch.manual_seed(0)
    module = DropoutRecorder()
    callbacks = [
        GradientAccumulation(2),
        SeedableSampler(8),
        rotation(project, every_n_train_steps=None, every_n_epochs=1),
    ]
    trainer_kwargs.setdefault("max_epochs", 3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="acc_no",
        logger=False,
        enable_progress_bar=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(samples(), batch_size=2, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_from_an_epoch_end_checkpoint_is_exact_in_one_process(tmp_path: Path) -> None:
    uninterrupted, _ = fit_three_epochs(tmp_path / "full")
    fit_three_epochs(tmp_path / "stopped", max_epochs=1)
    resumed, trainer = fit_three_epochs(tmp_path / "stopped", "last")
    assert trainer.ckpt_path == str(tmp_path / "stopped" / "checkpoints" / "checkpoint_0")
    assert resumed.seen == uninterrupted.seen[5:]
    for name, value in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_fresh_run_in_a_used_project_dir_refuses_to_overwrite(tmp_path: Path) -> None:
    fit([rotation(tmp_path)], max_steps=1)
    with pytest.raises(ValueError, match="checkpoint_0 already exists"):
        fit([rotation(tmp_path)], max_steps=1)


def test_latest_checkpoint_ignores_incomplete_and_foreign_entries(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for name in ("checkpoint_2", "checkpoint_10", ".checkpoint_11.incomplete", "checkpoint_x", "notes.txt"):
        (directory / name).write_text("")
    (directory / "checkpoint_9").mkdir()
    assert [p.name for p in complete_checkpoints(directory)] == ["checkpoint_2", "checkpoint_9", "checkpoint_10"]
    assert latest_checkpoint(str(tmp_path)) == str(directory / "checkpoint_10")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: GradientAccumulation(0), "num_steps.* must be a positive integer, got 0"),
        (lambda p: rotation(p, total_limit=-1), "total_limit must be a positive integer or None, got -1"),
        (lambda p: rotation(p, every_n_train_steps=None), "needs a cadence: pass every_n_train_steps=N"),
        (lambda p: rotation(p, every_n_epochs=1), "pass only one of them"),
        (lambda p: rotation(p, every_n_train_steps=0), "every_n_train_steps.* must be a positive integer"),
        (lambda p: CheckpointRotation(ProjectConfiguration(), every_n_epochs=1), r"ProjectConfiguration\(project_dir="),
        (
            lambda p: CheckpointRotation(ProjectConfiguration(p), every_n_epochs=1),
            "automatic_checkpoint_naming=False",
        ),
        (lambda p: SeedableSampler(data_seed=-1), "data_seed.* must be a non-negative integer"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_the_fix(tmp_path: Path, build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(tmp_path)


def test_total_limit_changed_after_construction_is_checked_too(tmp_path: Path) -> None:
    config = ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True)
    config.total_limit = -1
    with pytest.raises(ValueError, match=r"total_limit=-1\) must be a positive integer"):
        CheckpointRotation(config, every_n_epochs=1)


def test_rng_states_round_trip_and_gather_without_a_process_group() -> None:
    states = collect_rng_states()
    before = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng_states(states)
    after = (random.random(), np.random.rand(), torch.rand(1))
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])
    assert len(gather_rng_states()) == 1
    with pytest.raises(ValueError, match="lack numpy_random_seed"):
        restore_rng_states({"random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()})


@pytest.mark.launch
@pytest.mark.parametrize("background", [False, True], ids=["sync", "AsyncNamingCheckpointIO"])
def test_sigkill_during_a_save_leaves_earlier_checkpoints_intact_and_resumable(
    tmp_path: Path, background: bool
) -> None:
    ready = tmp_path / "stalled"
    script = SCRIPTS / "callbacks_kill_during_save.py"
    io_flag = ["--background"] if background else []
    command = [sys.executable, str(script), "--mode", "train", "--project", str(tmp_path), "--ready", str(ready)]
    command += io_flag
    process = subprocess.Popen(command, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if process.poll() is not None:
                raise AssertionError(
                    f"the training process exited early ({process.returncode}):\n{process.stderr.read()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError("the training process never reached the stalled save")
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        assert process.stderr is not None
        process.stderr.close()

    directory = tmp_path / "checkpoints"
    partial = Path(ready.read_text())
    written = ".checkpoint_2.incomplete.writing" if background else ".checkpoint_2.incomplete"
    assert partial == directory / written and partial.stat().st_size > 0
    assert [p.name for p in complete_checkpoints(directory)] == ["checkpoint_0", "checkpoint_1"]
    for name in ("checkpoint_0", "checkpoint_1"):
        torch.load(directory / name, weights_only=True)
    assert latest_checkpoint(tmp_path) == str(directory / "checkpoint_1")

    resume = [str(script), "--mode", "resume", "--project", str(tmp_path), "--max-steps", "4", *io_flag]
    proc = run_python(resume, timeout=120)
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    assert summary["resumed_at_step"] == 2
    assert summary["global_step"] == 4
    # Numbering continues from the restored counter; the partial write is gone; the limit holds.
    assert summary["entries"] == summary["checkpoints"] == ["checkpoint_2", "checkpoint_3"]
