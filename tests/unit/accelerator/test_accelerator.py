"""Unit tests of the Accelerator shim in one process: accumulation, stepping, data loaders, checkpoints, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator
from lightning_accel._accelerator.fabric import Launch, detect_launch
from lightning_accel.data_loader import DataLoaderShard, SeedableRandomSampler, skip_first_batches
from lightning_accel.state import AcceleratorState, GradientState, PartialState, reset_state
from lightning_accel.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)


@pytest.fixture(autouse=True)
def _no_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def loader(n: int = 10, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size, shuffle=shuffle)


def setup(**kwargs: Any) -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, **kwargs)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    return accelerator, model, optimizer, data


def run_epoch(accelerator: Accelerator, model: Any, optimizer: Any, data: Any) -> list[tuple[bool, int]]:
    seen = []
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        seen.append((accelerator.sync_gradients, accelerator.step))
    return seen


def test_accumulation_windows_follow_accelerate() -> None:
    accelerator, model, optimizer, data = setup(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    data = accelerator.prepare(loader(n=20))  # 5 batches
    expected = [(False, 1), (True, 2), (False, 3), (True, 4), (True, 0)]
    assert run_epoch(accelerator, model, optimizer, data) == expected
    assert run_epoch(accelerator, model, optimizer, data) == expected


def test_without_sync_with_dataloader_the_count_carries_over() -> None:
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    accelerator, model, optimizer, _ = setup(gradient_accumulation_plugin=plugin)
    data = accelerator.prepare(loader(n=20))
    syncs = [s for _ in range(2) for s, _ in run_epoch(accelerator, model, optimizer, data)]
    assert syncs == [False, True] * 5


def test_optimizer_steps_only_on_sync_and_backward_divides_the_loss() -> None:
    accelerator, model, optimizer, data = setup(gradient_accumulation_steps=2)
    x, y = next(iter(data))
    before = model.weight.detach().clone()
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert not accelerator.sync_gradients
    assert torch.equal(model.weight, before)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(accelerator.unwrap_model(model).state_dict())
    (nn.functional.mse_loss(reference(x), y) / 2).backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def test_scheduler_steps_with_the_optimizer_or_every_call() -> None:
    for with_optimizer, expected in ((True, 3), (False, 5)):
        reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_optimizer)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(n=20), scheduler)
        for x, y in data:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        assert scheduler.get_last_lr() == [0.5**expected]
        assert not accelerator.optimizer_step_was_skipped


def test_prepare_returns_objects_in_order_and_passes_others_through() -> None:
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    marker = object()
    out = accelerator.prepare(scheduler, loader(), marker, optimizer, model)
    assert [type(o).__name__ for o in out] == [
        "AcceleratedScheduler",
        "DataLoaderShard",
        "object",
        "AcceleratedOptimizer",
        "AcceleratedModule",
    ]
    assert out[2] is marker
    assert out[0].optimizers == [out[3]]
    assert accelerator.unwrap_model(out[4]) is model


def test_process_information_in_one_process() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    assert (accelerator.num_processes, accelerator.process_index, accelerator.local_process_index) == (1, 0, 0)
    assert accelerator.is_main_process and accelerator.is_local_main_process and accelerator.is_last_process
    assert not accelerator.use_distributed
    assert accelerator.distributed_type == "NO"
    assert accelerator.mixed_precision == "bf16"
    assert accelerator.device == torch.device("cpu")
    assert PartialState().num_processes == 1
    assert AcceleratorState().mixed_precision == "bf16"


def test_bf16_autocast_on_cpu() -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    a = torch.randn(4, 4)
    with accelerator.autocast():
        assert (a @ a).dtype == torch.bfloat16
    assert (a @ a).dtype == torch.float32


def test_reset_state_forgets_everything() -> None:
    Accelerator(cpu=True, gradient_accumulation_steps=3)
    assert GradientState().num_steps == 3
    reset_state()
    assert GradientState().num_steps == 1
    assert not GradientState().in_dataloader
    assert PartialState().distributed_type == "NO"


def test_gather_for_metrics_and_reduce_in_one_process() -> None:
    accelerator = Accelerator(cpu=True)
    data = accelerator.prepare(loader(n=10, batch_size=4))
    counts = [accelerator.gather_for_metrics(x).shape[0] for x, _ in data]
    assert counts == [4, 4, 2]
    assert accelerator.gather_for_metrics(["a", "b"]) == ["a", "b"]
    assert accelerator.reduce(torch.tensor(2.0)).item() == 2.0


def test_data_loader_end_remainder_and_epochs() -> None:
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
    )
    data = accelerator.prepare(loader(n=10, batch_size=4, shuffle=True))
    assert isinstance(data, DataLoaderShard) and len(data) == 3
    ends = []
    for _ in data:
        ends.append((data.end_of_dataloader, data.remainder, GradientState().in_dataloader))
    assert ends == [(False, 2, True), (False, 2, True), (True, 2, True)]
    assert not GradientState().in_dataloader
    assert data.iteration == 1
    sampler = data.batch_sampler.sampler
    assert isinstance(sampler, SeedableRandomSampler)
    first = [b[0].clone() for b in skip_first_batches(data, 1)]
    assert len(first) == 2


def test_seedable_sampler_matches_accelerate() -> None:
    from accelerate.data_loader import SeedableRandomSampler as HFSampler

    ours, theirs = SeedableRandomSampler(range(13), data_seed=3), HFSampler(range(13), data_seed=3)
    for epoch in range(3):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)


def test_save_and_load_state_round_trip_and_rotation(tmp_path: Path) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, optimizer, data = setup(project_config=config)
    run_epoch(accelerator, model, optimizer, data)
    for _ in range(3):
        accelerator.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    accelerator.project_configuration.iteration = 0
    assert Path(accelerator.load_state()).name == "checkpoint_2"
    assert accelerator.save_iteration == 3
    for key, value in accelerator.unwrap_model(model).state_dict().items():
        assert torch.equal(value, saved[key])


def test_save_state_errors(tmp_path: Path) -> None:
    accelerator, *_ = setup(project_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs output_dir"):
        accelerator.save_state()
    accelerator.project_configuration.automatic_checkpoint_naming = True
    with pytest.raises(ValueError, match="automatic_checkpoint_naming is on"):
        accelerator.save_state(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="state_dict"):
        accelerator.register_for_checkpointing(object())


def test_truncated_file_is_named(tmp_path: Path) -> None:
    accelerator, *_ = setup()
    accelerator.save_state(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        accelerator.load_state(tmp_path / "ckpt")


class _FractionScheduler(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose state holds a ``Fraction``, which ``torch.load(weights_only=True)`` refuses."""

    def state_dict(self) -> dict[str, Any]:
        from fractions import Fraction

        return {**super().state_dict(), "ratio": Fraction(1, 3)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ratio = state_dict.pop("ratio")
        super().load_state_dict(state_dict)


def test_load_state_passes_load_kwargs_to_torch_load_and_missing_ok_returns_none(tmp_path: Path) -> None:
    from fractions import Fraction

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator, _, optimizer, _ = setup(project_config=config)
    scheduler = accelerator.prepare(_FractionScheduler(optimizer.optimizer, lambda epoch: 1.0))
    assert accelerator.load_state(missing_ok=True) is None  # no checkpoint yet: a fresh start
    assert accelerator.load_state(tmp_path / "nowhere", missing_ok=True) is None
    with pytest.raises(ValueError, match="No checkpoint_<i> folder"):
        accelerator.load_state()
    accelerator.save_state()
    with pytest.raises(ValueError, match=r"scheduler\.bin"):  # Accelerate's default: weights_only
        accelerator.load_state()
    loaded = accelerator.load_state(None, {"weights_only": False}, missing_ok=True)
    assert loaded is not None and Path(loaded).name == "checkpoint_0"
    assert scheduler.scheduler.ratio == Fraction(1, 3)


def test_custom_object_count_must_match(tmp_path: Path) -> None:
    accelerator, *_ = setup()
    accelerator.save_state(tmp_path / "ckpt")
    accelerator.register_for_checkpointing(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0))
    with pytest.raises(ValueError, match="0 custom_checkpoint"):
        accelerator.load_state(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"gradient_accumulation_steps": 2, "gradient_accumulation_plugin": GradientAccumulationPlugin(2)},
            ValueError,
            "not both",
        ),
        ({"mixed_precision": "fp12"}, ValueError, "fp12"),
        ({"dataloader_config": {"split_batches": True}}, TypeError, "dataloader_config"),
        ({"kwargs_handlers": [object()]}, TypeError, "Unsupported kwargs handler"),
        (
            {"kwargs_handlers": [DistributedDataParallelKwargs(), DistributedDataParallelKwargs()]},
            ValueError,
            "two DistributedDataParallelKwargs",
        ),
        ({"rng_types": ["xla"]}, ValueError, "rng_types"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Accelerator(cpu=True, **kwargs)


def test_detect_launch_reads_the_launchers_variables() -> None:
    assert detect_launch({}) == Launch(1, 1)
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert detect_launch(torchrun) == Launch(4, 2)
    assert detect_launch(torchrun).num_nodes == 2
    assert detect_launch({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_JOB_NAME": "job"}) == Launch(
        4, 2
    )
    assert detect_launch({"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "bash"}) == Launch(1, 1)
    assert detect_launch({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Launch(2, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        detect_launch({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "two"})


def test_detect_launch_refuses_a_submitit_local_task_without_torchs_variables() -> None:
    """submitit's local executor conveys the ranks in its own variables only: each task would train alone."""
    task = {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}
    with pytest.raises(ValueError, match=r"task 1 of a submitit local job of SUBMITIT_LOCAL_NTASKS=2 tasks.*export"):
        detect_launch(task)
    exported = {**task, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert detect_launch(exported) == Launch(2, 2)  # TorchDistributedEnvironment().export() set torch's variables
    assert detect_launch({"SUBMITIT_LOCAL_NTASKS": "1"}) == Launch(1, 1)


def resumable_run(project_dir: Path) -> tuple[Accelerator, Any, Any, Any, Any]:
    reset_state()
    config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=4),
        project_config=config,
    )
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(n=18, shuffle=True), scheduler)
    return accelerator, model, optimizer, data, scheduler


def train_epoch(accelerator: Accelerator, model: Any, optimizer: Any, data: Any, scheduler: Any) -> None:
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def test_resume_after_an_epoch_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    run = resumable_run(tmp_path / "straight")
    for _ in range(3):
        train_epoch(*run[:4], run[4])
    expected = {k: v.clone() for k, v in run[0].unwrap_model(run[1]).state_dict().items()}

    first = resumable_run(tmp_path / "stopped")
    train_epoch(*first[:4], first[4])
    first[0].save_state()
    resumed = resumable_run(tmp_path / "stopped")
    torch.manual_seed(123)  # the checkpoint's RNG states replace this
    resumed[0].load_state()
    assert resumed[3].iteration == 1  # the loader continues with epoch 1's order
    for _ in range(2):
        train_epoch(*resumed[:4], resumed[4])
    for key, value in resumed[0].unwrap_model(resumed[1]).state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert resumed[4].get_last_lr() == run[4].get_last_lr()


def test_process_helpers_in_one_process() -> None:
    accelerator = Accelerator(cpu=True)
    with accelerator.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]

    @accelerator.on_process(process_index=3)
    def anywhere() -> int:
        return 1

    assert anywhere() == 1  # one process runs everything, as in Accelerate
    assert accelerator.on_last_process(lambda: 2)() == 2
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger()
    assert not accelerator.check_trigger()
    with pytest.raises(ValueError, match="process_index"):
        accelerator.on_process()


def test_split_between_processes_validates_input() -> None:
    state = PartialState()
    state._configure(state.distributed_type, state.device, num_processes=2, process_index=1, local_index=1)
    with pytest.raises(ValueError, match="one length"), state.split_between_processes({"a": [1], "b": [1, 2]}):
        pass
    with pytest.raises(TypeError, match="set"), state.split_between_processes({1, 2}):
        pass
    with state.split_between_processes(torch.arange(3).reshape(3, 1), apply_padding=True) as share:
        assert share.tolist() == [[2], [2]]


def deep_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


SHARDS_1KB = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
SHARDS_700 = [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)] + ["pytorch_model.bin.index.json"]


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(
    ("max_shard_size", "safe", "files"),
    [("10GB", True, ["model.safetensors"]), ("1KB", True, SHARDS_1KB), (700, False, SHARDS_700)],
)
def test_save_model_writes_accelerates_files(
    tmp_path: Path, max_shard_size: int | str, safe: bool, files: list[str]
) -> None:
    import accelerate
    from accelerate.state import AcceleratorState as HFAcceleratorState
    from accelerate.state import GradientState as HFGradientState

    try:
        accelerate.Accelerator(cpu=True).save_model(deep_model(), tmp_path / "hf", max_shard_size, safe)
    finally:
        HFAcceleratorState._reset_state(True)
        HFGradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(deep_model())
    accelerator.save_model(model, tmp_path / "ours", max_shard_size=max_shard_size, safe_serialization=safe)
    ours, theirs = (
        sorted(p.name for p in (tmp_path / "ours").iterdir()),
        sorted(p.name for p in (tmp_path / "hf").iterdir()),
    )
    assert ours == theirs == files  # one file under 10GB; 2 safetensors shards of 1KB; 3 .bin shards of 700 bytes
    merged: dict[str, torch.Tensor] = {}
    for name in ours:
        if name.endswith(".json"):
            assert (tmp_path / "ours" / name).read_text() == (tmp_path / "hf" / name).read_text()
            continue
        shard, hf_shard = _read_weights(tmp_path / "ours" / name), _read_weights(tmp_path / "hf" / name)
        assert shard.keys() == hf_shard.keys(), name  # the same tensors in the same shard as HF's
        for key, value in shard.items():
            assert torch.equal(value, hf_shard[key]), (name, key)
        assert not merged.keys() & shard.keys(), name  # each tensor in one shard only
        merged.update(shard)
    expected = deep_model().state_dict()
    assert merged.keys() == expected.keys()  # the shards together hold the whole model, with its values
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key


def test_save_model_removes_stale_shards_and_checks_sizes(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(deep_model())
    accelerator.save_model(model, tmp_path, max_shard_size="1KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    accelerator.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.safetensors.index.json"]
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        accelerator.save_model(model, tmp_path, max_shard_size="lots")
    with pytest.raises(ValueError, match="is a file"):
        accelerator.save_model(model, tmp_path / "model.safetensors")


def test_state_pre_hooks_can_take_over_models(tmp_path: Path) -> None:
    accelerator, model, *_ = setup()
    calls: list[str] = []

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        calls.append(f"save {len(models)}")
        Path(output_dir, "extra.txt").write_text("hook")  # lands in the checkpoint once it is complete
        weights.pop()

    def load_hook(models: list[Any], input_dir: str) -> None:
        calls.append(f"load {len(models)} {Path(input_dir).name}")
        models.pop()

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "extra.txt").read_text() == "hook"
    accelerator.load_state(tmp_path / "ckpt")  # the hook took the model: no weights file needed
    handle.remove()
    accelerator.save_state(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").is_file()
    assert calls == ["save 1", "load 1 ckpt"]
    assert set(accelerator.get_state_dict(model)) == {"weight", "bias"}


def test_save_writes_once_and_checks_safe_input(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.save({"a": [1, 2]}, tmp_path / "obj.pt")
    assert torch.load(tmp_path / "obj.pt") == {"a": [1, 2]}
    accelerator.save({"t": torch.ones(2)}, tmp_path / "t.safetensors", safe_serialization=True)
    assert (tmp_path / "t.safetensors").is_file()
    with pytest.raises(TypeError, match="dict of tensors"):
        accelerator.save([1], tmp_path / "x.safetensors", safe_serialization=True)


def test_clip_grad_norm_and_value_match_torch() -> None:
    accelerator, model, _, data = setup()
    x, y = next(iter(data))
    accelerator.backward(nn.functional.mse_loss(model(x), y) * 100)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(clipped, torch.tensor(0.5), atol=1e-5, rtol=0)
    accelerator.clip_grad_norm_([model.weight], max_norm=0.1)  # a subset: clipped directly
    assert float(model.weight.grad.norm()) <= 0.1 + 1e-6
    accelerator.clip_grad_value_(model.parameters(), clip_value=0.01)
    assert all(float(p.grad.abs().max()) <= 0.01 for p in model.parameters())


def test_free_memory_drops_references_and_resets_step() -> None:
    accelerator, model, optimizer, data = setup(gradient_accumulation_steps=2)
    run_epoch(accelerator, model, optimizer, data)
    accelerator.step = 3
    assert accelerator.free_memory(model, optimizer) == [None, None]
    assert accelerator.step == 0
    assert accelerator._models == [] and accelerator._optimizers == []


def test_resume_mid_epoch_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    run = resumable_run(tmp_path / "straight")
    for _ in range(2):
        train_epoch(*run[:4], run[4])
    expected = {k: v.clone() for k, v in run[0].unwrap_model(run[1]).state_dict().items()}

    accelerator, model, optimizer, data, scheduler = resumable_run(tmp_path / "stopped")
    train_epoch(accelerator, model, optimizer, data, scheduler)
    for index, (x, y) in enumerate(data):  # epoch 1, stopped after its second batch
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if index == 1:
            accelerator.save_state()
            break
    accelerator, model, optimizer, data, scheduler = resumable_run(tmp_path / "stopped")
    accelerator.load_state(resume_position=True)
    assert (data.iteration, data.resume_position, accelerator.step) == (1, 2, 2)
    train_epoch(accelerator, model, optimizer, data, scheduler)  # the rest of epoch 1
    for key, value in accelerator.unwrap_model(model).state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert data.position == 0 and data.iteration == 2


def test_load_state_resumes_at_the_epochs_first_batch_for_a_loop_that_skips_itself(tmp_path: Path) -> None:
    """diffusers' scripts (and Accelerate's docs) skip the batches already trained on after ``load_state``."""
    import accelerate

    import lightning_accel
    from tests.helpers import reset_accelerator_states

    seen = {}
    for library in (accelerate, lightning_accel):
        reset_accelerator_states()
        accelerator = library.Accelerator(cpu=True)
        data = accelerator.prepare(DataLoader(torch.arange(10), batch_size=1))
        for step, _ in enumerate(data):
            if step == 3:
                accelerator.save_state(str(tmp_path / library.__name__))
                break
        accelerator.load_state(str(tmp_path / library.__name__))
        seen[library.__name__] = [int(batch) for step, batch in enumerate(data) if step >= 3]
    reset_accelerator_states()
    assert seen["lightning_accel"] == seen["accelerate"] == list(range(3, 10))


def test_set_epoch_elsewhere_or_skip_first_batches_take_the_restored_position() -> None:
    accelerator = Accelerator(cpu=True)
    data = accelerator.prepare(loader(n=20))
    data.iteration, data.resume_position = 1, 3
    skipping = skip_first_batches(data, 3)
    assert data.resume_position == 0 and len(list(skipping)) == 2
    data.resume_position = 3
    data.set_epoch(4)
    assert data.resume_position == 0 and len(list(data)) == 5


def test_autocast_handlers_disable_autocast() -> None:
    from lightning_accel.utils import AutocastKwargs

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    a = torch.randn(2, 2)
    with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert (a @ a).dtype == torch.float32
    reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with accelerator.autocast():
        assert (a @ a).dtype == torch.float32


def test_the_user_module_computes_in_bf16_when_called_unwrapped_as_hf() -> None:
    """Accelerate's prepare puts autocast on the user's module's own forward: generation loops (TRL) and validation
    pipelines call the unwrapped model and must compute in the mixed dtype too (TRL's GRPO differed before)."""
    import accelerate
    from accelerate.state import AcceleratorState as HFAcceleratorState
    from accelerate.state import GradientState as HFGradientState

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def outputs(make: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        plain = model(x)
        accelerator = make()
        prepared = accelerator.prepare(model)
        unwrapped = accelerator.unwrap_model(prepared)
        direct, through = unwrapped(x), prepared(x)
        restored = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)(x)
        return plain, direct, through, restored

    try:
        hf = outputs(lambda: accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    finally:
        HFAcceleratorState._reset_state(True)
        HFGradientState._reset_state()
    ours = outputs(lambda: Accelerator(cpu=True, mixed_precision="bf16"))
    for mine, theirs in zip(ours, hf, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32
        assert torch.equal(mine, theirs)
    plain, direct, through, restored = ours
    assert torch.equal(direct, through) and not torch.equal(direct, plain)  # bf16 matmuls, fp32 outputs
    assert torch.equal(restored, plain)  # keep_fp32_wrapper=False: the module's own fp32 forward again
