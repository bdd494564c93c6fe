"""save_state/load_state under FSDP and DeepSpeed on 2 CPU processes (one torchrun launch; see the script).

Exact resume (bit-identical weights and learning rate), Accelerate 1.15's file names, the same content as HF
accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` write, loading in both directions, and ``save_model``.
The same launch trains with Accelerate's DeepSpeed rules (default clipping, ``sync_each_batch``) against DDP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from tests.helpers import load_rank_results, torchrun

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

FSDP = ["fsdp2_sharded", "fsdp2_full", "fsdp1_sharded", "fsdp1_full"]
ZERO = ["zero2", "zero3"]
HF_WROTE = ["fsdp2_sharded", "fsdp2_full", "fsdp1_sharded"]  # where HF accelerate's FSDP functions run on CPU
KEYS = {"0.weight", "0.bias", "2.weight", "2.bias"}
COMMON = [MANIFEST_NAME, "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]  # ours: HF has no manifest


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    out = tmp_path_factory.mktemp("sharded_ckpt")
    torchrun("accelerator_sharded_ckpt.py", "--out", str(out), timeout=300)
    return out, load_rank_results(out)


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _contents(path: Path, scratch: Path) -> Any:
    """What a ``torch.save`` file or a ``torch.distributed.checkpoint`` directory holds (converted in ``scratch``)."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)


def _assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    assert type(ours) is type(theirs), where
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            _assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


@pytest.mark.launch
@pytest.mark.parametrize("variant", FSDP + ZERO)
def test_engines_train_as_ddp(run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str) -> None:
    reference = run[1]["ddp"][0]["a"]["final"]
    final = run[1][variant][0]["a"]["final"]
    for key in KEYS:  # DeepSpeed accumulates through the engine (it divides the loss), the others in the shim
        torch.testing.assert_close(final[key], reference[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["ddp", *FSDP, *ZERO])
def test_resume_is_exact(run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str) -> None:
    main = run[1][variant][0]
    a, b = main["a"], main["b"]
    assert set(a["final"]) == KEYS
    assert any(not torch.equal(a["saved"][k], b["initial"][k]) for k in KEYS)  # run B really started elsewhere
    for key in KEYS:
        assert torch.equal(a["final"][key], b["final"][key]), key
    assert a["lr"] == b["lr"]


@pytest.mark.launch
@pytest.mark.parametrize("variant", [*FSDP, "zero3"])
def test_gathered_weights_only_on_the_main_process(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    assert run[1][variant][1]["a"]["final"] == {}  # get_state_dict gathers to the main process, as Accelerate


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "files"),
    [
        ("fsdp2_sharded", ["optimizer_0", "pytorch_model_fsdp_0"]),
        ("fsdp1_sharded", ["optimizer_0", "pytorch_model_fsdp_0"]),
        ("fsdp2_full", ["optimizer.bin", "pytorch_model_fsdp.bin"]),
        ("fsdp1_full", ["optimizer.bin", "pytorch_model_fsdp.bin"]),
    ],
)
def test_fsdp_file_names_are_accelerates(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str, files: list[str]
) -> None:
    checkpoint = run[0] / variant / "checkpoint"
    assert _entries(checkpoint) == sorted(files + COMMON)
    for folder in (checkpoint / name for name in files if not name.endswith(".bin")):
        assert _entries(folder) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one shard file per process


@pytest.mark.launch
@pytest.mark.parametrize("variant", HF_WROTE)
def test_fsdp_files_hold_what_hf_accelerate_writes(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str, tmp_path: Path
) -> None:
    ours, hf = run[0] / variant / "checkpoint", run[0] / variant / "hf"
    names = _entries(hf)
    assert names == [n for n in _entries(ours) if n not in COMMON]
    for name in names:
        _assert_same(_contents(ours / name, tmp_path), _contents(hf / name, tmp_path), name)


@pytest.mark.launch
@pytest.mark.parametrize("variant", HF_WROTE)
def test_hf_accelerate_loads_ours_and_we_load_hfs(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    main = run[1][variant][0]
    for key in KEYS:  # HF's load_fsdp_model read our files
        assert torch.equal(main["b"]["hf_loaded_ours"][key], main["a"]["saved"][key]), key
    # Run B resumed (exactly, see test_resume_is_exact) from a folder whose model and optimizer files are HF's.
    mixed, saved = _entries(run[0] / variant / "ours_with_hf_files"), _entries(run[0] / variant / "checkpoint")
    assert mixed == [name for name in saved if name != MANIFEST_NAME]  # a mixed folder is not what was saved


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "engine_files"),
    [
        ("zero2", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
        ("zero3", ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    ],
)
def test_deepspeed_checkpoint_is_the_engines_folder(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str, engine_files: list[str]
) -> None:
    checkpoint = run[0] / variant / "checkpoint"
    entries = _entries(checkpoint)
    assert {"latest", "pytorch_model", "zero_to_fp32.py", *COMMON} <= set(entries)
    assert not {"model.safetensors", "optimizer.bin", "pytorch_model.bin"} & set(entries)
    assert (checkpoint / "latest").read_text().strip() == "pytorch_model"  # the tag Accelerate passes
    assert set(engine_files) <= set(_entries(checkpoint / "pytorch_model"))


@pytest.mark.launch
@pytest.mark.parametrize("variant", FSDP + ZERO)
def test_save_model_writes_the_gathered_weights(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    from safetensors.torch import load_file

    saved = load_file(run[0] / variant / "model" / "model.safetensors")
    final = run[1][variant][0]["a"]["final"]
    assert saved.keys() == final.keys()
    for key in KEYS:
        assert torch.equal(saved[key], final[key]), key


# ---- without processes: dispatch and errors ------------------------------------------------------------------------


class _ZeRO3Engine(torch.nn.Module):
    """What DeepSpeedCheckpoint asks of an engine, for a ZeRO-3 run without 16-bit gathering."""

    def zero_optimization_partition_weights(self) -> bool:
        return True

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return False


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["zero2", "zero2_no_clip_call", "zero1_each_batch", "zero2_each_batch"])
def test_deepspeed_clips_at_accelerates_default_and_accumulates_with_sync_each_batch(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    rules = run[1]["deepspeed_rules"][0]
    reference, unclipped = rules["ddp_clip"]["final"], rules["ddp_unclipped"]["final"]
    assert any((reference[k] - unclipped[k]).abs().max() > 1e-3 for k in KEYS)  # the gradients were clipped
    for key in KEYS:
        torch.testing.assert_close(rules[variant]["final"][key], reference[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["zero2", "zero2_each_batch"])
def test_deepspeed_clip_grad_norm_returns_the_engines_global_norm(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    """As Accelerate: the engine stepped (and clipped) in ``backward``; ``clip_grad_norm_`` returns its norm."""
    for rank, rules in enumerate(run[1]["deepspeed_rules"]):
        reference, norms = rules["ddp_clip"]["norms"], rules[variant]["norms"]
        assert len(norms) == len(reference) == 4, rank  # 8 micro-batches per process, accumulation 2
        assert all(isinstance(n, float) for n in norms), rank  # a float, as HF accelerate's wrapper returns
        assert min(reference) > 1.0  # large gradients: every step clipped
        torch.testing.assert_close(norms, reference, rtol=1e-6, atol=0, msg=f"rank {rank}")
        assert not any(rules[variant]["skipped"]), rank


@pytest.mark.launch
def test_deepspeed_engine_gets_accelerates_config(run: tuple[Path, dict[str, list[dict[str, Any]]]]) -> None:
    from tests.unit.accelerator.test_deepspeed import hf_prepared_config

    expected = hf_prepared_config(
        {"zero_stage": 2}, mixed_precision="no", accumulation=2, batch_sizes=(2,), world_size=2
    )
    assert expected["gradient_clipping"] == 1.0 and expected["train_batch_size"] == 8
    for rank in run[1]["deepspeed_rules"]:
        assert rank["zero2"]["config"] == expected


def test_engine_is_chosen_by_the_strategy_class() -> None:
    from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint
    from lightning_accel.strategies.fsdp import FabricAcceleratedFSDPStrategy
    from lightning_accel.strategies.single_device import FabricAcceleratedSingleDeviceStrategy
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    assert FabricAcceleratedSingleDeviceStrategy(torch.device("cpu")).checkpoint_engine() is None
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    engine = FabricAcceleratedFSDPStrategy(plugin).checkpoint_engine()
    assert isinstance(engine, FSDPCheckpoint) and engine.full


def test_zero3_state_dict_needs_16bit_gathering() -> None:
    from lightning_accel.checkpoint.engines import DeepSpeedCheckpoint

    with pytest.raises(ValueError, match=r"DeepSpeedPlugin\(zero3_save_16bit_model=True\)"):
        DeepSpeedCheckpoint().full_state_dict(_ZeRO3Engine(), [])


def test_missing_files_raise_before_loading(tmp_path: Path) -> None:
    from lightning_accel.checkpoint.engines import DeepSpeedCheckpoint
    from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint

    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"no weights for model 0: expected pytorch_model_fsdp_0 or pytorch_model_fsdp"
    ):
        FSDPCheckpoint("SHARDED_STATE_DICT").load([model], [], tmp_path)
    with pytest.raises(ValueError, match=r"no DeepSpeed checkpoint for model 0: expected pytorch_model\."):
        DeepSpeedCheckpoint().load([model], [], tmp_path)


def test_fsdp_local_state_dict_and_deepspeed_options_are_refused(tmp_path: Path) -> None:
    from lightning_accel.checkpoint.fsdp_layout import FSDPCheckpoint

    with pytest.raises(ValueError, match=r"state_dict_type='LOCAL_STATE_DICT'.*SHARDED_STATE_DICT"):
        FSDPCheckpoint("LOCAL_STATE_DICT").save([], [], tmp_path)
    with pytest.raises(ValueError, match=r"\['tag'\].*uses FSDP; drop them"):
        FSDPCheckpoint("SHARDED_STATE_DICT").save([], [], tmp_path, tag="x")


def test_deepspeed_options_need_deepspeed(tmp_path: Path) -> None:
    from lightning_accel import Accelerator
    from lightning_accel.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"\['exclude_frozen_parameters'\].*DistributedType.NO; drop them"):
        accelerator.save_state(tmp_path / "ckpt", exclude_frozen_parameters=True)
    assert not (tmp_path / "ckpt").exists()
    reset_state()


def test_deepspeed_accumulation_must_match_the_loop() -> None:
    from lightning_accel.strategies.deepspeed import _loop_accumulation

    assert _loop_accumulation({"gradient_accumulation_steps": "auto"}, 4) == 4
    assert _loop_accumulation({"gradient_accumulation_steps": 4}, 4) == 4
    assert _loop_accumulation({"gradient_accumulation_steps": 4}, None) is None  # plain Fabric: the config decides
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4, but the training loop accumulates 1"):
        _loop_accumulation({"gradient_accumulation_steps": 4}, 1)


def test_deepspeed_clip_grad_norm_reads_the_engine_and_warns_that_max_norm_is_ignored() -> None:
    import warnings
    from types import SimpleNamespace

    from lightning_accel._accelerator.engine_step import global_grad_norm

    engine = SimpleNamespace(gradient_clipping=lambda: 1.0, get_global_grad_norm=lambda: torch.tensor(3.5))
    strategy: Any = SimpleNamespace(step_engine=lambda: engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert global_grad_norm(strategy, 1.0) == 3.5  # max_norm is the config's: nothing to say
    with pytest.warns(UserWarning, match=r"gradient_clipping \(1.0\); clip_grad_norm_'s max_norm=0.25 is ignored"):
        assert global_grad_norm(strategy, 0.25) == 3.5
    assert global_grad_norm(SimpleNamespace(step_engine=lambda: None), 1.0) is None  # type: ignore[arg-type]


def test_engine_stepped_optimizer_ignores_step_and_reports_the_overflow() -> None:
    from types import SimpleNamespace

    from lightning_accel.optimizer import AcceleratedOptimizer
    from lightning_accel.state import reset_state

    reset_state()
    calls: list[str] = []
    inner: Any = SimpleNamespace(
        step=lambda: calls.append("step"), zero_grad=lambda set_to_none: calls.append("zero"), overflow=True
    )
    optimizer = AcceleratedOptimizer(inner, engine_steps=True)
    optimizer.step()
    optimizer.zero_grad()
    assert calls == [] and not optimizer.step_was_skipped  # the engine stepped in Accelerator.backward
    optimizer.record_engine_step()
    assert optimizer.step_was_skipped  # DeepSpeed's fp16 overflow, as Accelerate's wrapper reads it
    reset_state()
