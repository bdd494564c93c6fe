"""acc_deepspeed: config reconciliation (no processes), registration, and 2 CPU processes (gloo) against ``ddp``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_accel.config import DeepSpeedPlugin
from lightning_accel.enums import DistributedType
from lightning_accel.strategies import strategy_for
from lightning_accel.strategies.deepspeed import (
    AcceleratedDeepSpeedStrategy,
    FabricAcceleratedDeepSpeedStrategy,
    consolidate_deepspeed_checkpoint,
)
from lightning_accel.strategies.deepspeed_core import (
    DeepSpeedFamily,
    TrainingFacts,
    fill_engine_autos,
    resolve_config,
)
from lightning_accel.utils import load_full_state_dict
from tests.helpers import SCRIPTS, load_rank_results, run_python, torchrun

NAMES = ["acc_deepspeed", "acc_deepspeed_stage_1", "acc_deepspeed_stage_2", "acc_deepspeed_stage_3"]
TRAINER_FLAGS = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
FACTS = TrainingFacts(world_size=2, device_type="cpu", micro_batch_size=8, micro_batch_size_required=True)


def facts(**changes: Any) -> TrainingFacts:
    return TrainingFacts(**{**FACTS.__dict__, **changes})


def plugin_config(**fields: Any) -> dict[str, Any]:
    return DeepSpeedPlugin(**fields).deepspeed_config


# --------------------------------------------------------------------------- reconciliation, one place, no processes


def test_auto_entries_take_the_trainer_values() -> None:
    config = resolve_config(plugin_config(), facts(accumulation=2, gradient_clip_val=0.5, precision="bf16-mixed"))
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 8 * 2 * 2
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert "fp16" not in config
    assert config["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize(("configured", "trainer", "expected"), [(4, 1, 4), (4, None, 4), (1, 2, 2), (2, 2, 2)])
def test_accumulation_default_one_yields_to_the_other_side(configured: int, trainer: int | None, expected: int) -> None:
    config = resolve_config(plugin_config(gradient_accumulation_steps=configured), facts(accumulation=trainer))
    assert config["gradient_accumulation_steps"] == expected
    assert config["train_batch_size"] == 8 * expected * 2


def test_accumulation_conflict_names_both_values_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*accumulate_grad_batches=2.*'auto'"):
        resolve_config(plugin_config(gradient_accumulation_steps=4), facts(accumulation=2))


def test_micro_batch_conflict_names_both_values_and_the_fix() -> None:
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=16.*batches of 8.*batch_size=16"):
        resolve_config(plugin_config(hf_ds_config=config), FACTS)


def test_train_batch_size_must_be_the_product() -> None:
    config = {"train_batch_size": 32, "zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match=r"train_batch_size=32.*8 x accumulation 1 x 2 processes = 16"):
        resolve_config(plugin_config(hf_ds_config=config), FACTS)
    config["gradient_accumulation_steps"] = "auto"
    assert resolve_config(plugin_config(hf_ds_config=config), facts(accumulation=2))["train_batch_size"] == 32


def test_unknown_batch_size_is_an_error_only_when_fitting() -> None:
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu='auto'.*no integer batch size"):
        resolve_config(plugin_config(), facts(micro_batch_size=None))
    config = resolve_config(plugin_config(), facts(micro_batch_size=None, micro_batch_size_required=False))
    assert config["train_micro_batch_size_per_gpu"] == 1


def test_clipping_conflict_and_adoption() -> None:
    assert resolve_config(plugin_config(gradient_clipping=1.0), FACTS)["gradient_clipping"] == 1.0
    assert resolve_config(plugin_config(gradient_clipping=0.0), facts(gradient_clip_val=2))["gradient_clipping"] == 2
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0.*gradient_clip_val=0.5"):
        resolve_config(plugin_config(gradient_clipping=1.0), facts(gradient_clip_val=0.5))


def test_precision_sections_follow_the_precision_and_conflicts_raise() -> None:
    config = {
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "bf16": {"enabled": "auto"},
    }
    resolved = resolve_config(plugin_config(hf_ds_config=config), facts(precision="16-mixed"))
    assert resolved["fp16"] == {"enabled": True, "loss_scale": 0}
    assert resolved["bf16"] == {"enabled": False}
    assert resolve_config(plugin_config(), facts(precision="16-mixed"))["fp16"]["initial_scale_power"] == 16
    config = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    with pytest.raises(ValueError, match=r"bf16.enabled=True.*precision is '32-true'.*'bf16-mixed'"):
        resolve_config(plugin_config(hf_ds_config=config), FACTS)


def test_cpu_offload_on_cpu_devices_keeps_the_torch_optimizer() -> None:
    fields = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
    assert resolve_config(plugin_config(**fields), FACTS)["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in resolve_config(plugin_config(**fields), facts(device_type="cuda"))


HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 10, "total_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
}


def test_transformers_style_config_is_filled_from_trainer_optimizer_and_model() -> None:
    resolved = resolve_config(plugin_config(hf_ds_config=HF_CONFIG), facts(accumulation=2, gradient_clip_val=1.0))
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=3e-4, betas=(0.8, 0.9), weight_decay=0.1)
    hparams = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
    final = fill_engine_autos(resolved, optimizer_hparams=hparams, total_steps=100, hidden_size=64)
    assert final["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0.1}
    assert final["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert final["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert final["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert (final["gradient_accumulation_steps"], final["gradient_clipping"]) == (2, 1.0)
    assert final["fp16"] == {"enabled": False}


def test_autos_nothing_can_fill_are_listed() -> None:
    resolved = resolve_config(plugin_config(hf_ds_config=HF_CONFIG), FACTS)
    with pytest.raises(ValueError, match=r"'optimizer.params.lr'.*'zero_optimization.reduce_bucket_size'"):
        fill_engine_autos(resolved)


def test_declared_optimizer_value_conflicting_with_the_code_raises() -> None:
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    resolved = resolve_config(plugin_config(hf_ds_config=config), FACTS)
    with pytest.raises(ValueError, match=r"optimizer.params.lr=0.001.*configure_optimizers has lr=0.1"):
        fill_engine_autos(resolved, optimizer_hparams={"lr": 0.1})


# --------------------------------------------------------------------------- names and construction, one process


def test_names_are_registered_for_trainer_and_fabric() -> None:
    for name in [*NAMES, "acc_deepspeed_stage_3_offload"]:
        assert StrategyRegistry[name]["strategy"] is AcceleratedDeepSpeedStrategy, name
        assert FABRIC_REGISTRY[name]["strategy"] is FabricAcceleratedDeepSpeedStrategy, name
    assert isinstance(strategy_for(DistributedType.DEEPSPEED), AcceleratedDeepSpeedStrategy)
    assert isinstance(strategy_for("DEEPSPEED", fabric=True), FabricAcceleratedDeepSpeedStrategy)


@pytest.mark.parametrize(
    ("name", "stage"), [("acc_deepspeed", 2), ("acc_deepspeed_stage_1", 1), ("acc_deepspeed_stage_3", 3)]
)
def test_names_set_the_zero_stage_on_cpu(name: str, stage: int) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, **TRAINER_FLAGS)
    assert isinstance(trainer.strategy, AcceleratedDeepSpeedStrategy)
    assert trainer.strategy.config["zero_optimization"]["stage"] == stage
    assert trainer.strategy.distributed_type is DistributedType.DEEPSPEED
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
    assert isinstance(fabric.strategy, FabricAcceleratedDeepSpeedStrategy)
    assert fabric.strategy.deepspeed_plugin.zero_stage == stage


def test_offload_name_offloads_optimizer_and_parameters_to_cpu() -> None:
    strategy = L.Fabric(accelerator="cpu", devices=2, strategy="acc_deepspeed_stage_3_offload").strategy
    zero = strategy.config["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == (3, "cpu", "cpu")


def test_plugin_type_and_double_configuration_are_refused() -> None:
    with pytest.raises(TypeError, match=r"`deepspeed_plugin` must be a DeepSpeedPlugin, got dict"):
        AcceleratedDeepSpeedStrategy({"zero_stage": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fixes DeepSpeedPlugin fields \{'zero_stage': 3\}.*'acc_deepspeed'"):
        AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(), plugin_fields={"zero_stage": 3})


def test_devices_other_than_cpu_and_cuda_are_refused() -> None:
    family = DeepSpeedFamily("acc_deepspeed", None)
    with pytest.raises(ValueError, match=r"'acc_deepspeed' runs on CPU or CUDA devices, got 'meta'.*accelerator='cpu'"):
        family.check_devices([torch.device("meta")])
    family.check_devices([torch.device("cpu"), torch.device("cpu")])


@pytest.mark.launch
def test_missing_deepspeed_names_the_install_command() -> None:
    code = (
        "import sys\n"
        "sys.modules['deepspeed'] = None\n"
        "import lightning as L, lightning_accel\n"
        "for make in (L.Trainer, L.Fabric):\n"
        "    try:\n"
        "        make(accelerator='cpu', devices=2, strategy='acc_deepspeed')\n"
        "    except ModuleNotFoundError as err:\n"
        "        print('ERROR', err)\n"
    )
    lines = [line for line in run_python(["-c", code], timeout=120).stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 2
    for line in lines:
        assert "'acc_deepspeed' needs the `deepspeed` package" in line
        assert "pip install 'lightning-accel[deepspeed]'" in line


# --------------------------------------------------------------------------- 2 CPU processes against ddp


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], Path]:
    out: Path = tmp_path_factory.mktemp("deepspeed_parity")
    torchrun("deepspeed_parity.py", "--out", str(out), timeout=600)
    found = load_rank_results(out)
    return found, out


@pytest.fixture(scope="module")
def results(run: tuple[dict[str, list[dict[str, Any]]], Path]) -> dict[str, list[dict[str, Any]]]:
    return run[0]


def assert_same_run(ours: list[dict[str, Any]], reference: list[dict[str, Any]], prefix: str = "") -> None:
    for rank, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert len(a["losses"]) == len(b["losses"]), rank
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=0, atol=1e-5)
        assert a["weights"].keys() == {k.removeprefix(prefix) for k in b["weights"]}
        for key, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][prefix + key], rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_lightning_ddp(results: dict[str, list[dict[str, Any]]], stage: int) -> None:
    ours = results[f"stage{stage}"]
    assert [r["strategy_class"] for r in ours] == ["AcceleratedDeepSpeedStrategy"] * 2
    assert [(r["engine_class"], r["zero_stage"], r["world_size"]) for r in ours] == [("DeepSpeedEngine", stage, 2)] * 2
    assert len(ours[0]["losses"]) == 12
    assert ours[0]["losses"] != ours[1]["losses"]  # each rank saw its own data
    assert_same_run(ours, results["ddp"])


@pytest.mark.launch
def test_compiled_model_under_deepspeed_matches_lightning_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    # TorchDynamoPlugin(backend="aot_eager") compiles the LightningModule's network before DeepSpeed wraps it.
    assert [r["compiled"] for r in results["stage2_compiled"]] == [True, True]
    assert not results["stage2"][0]["compiled"]
    assert_same_run(results["stage2_compiled"], results["ddp"])


@pytest.mark.launch
def test_stage3_with_cpu_offload_matches_lightning_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    ours = results["stage3_offload"]
    assert [r["zero_stage"] for r in ours] == [3, 3]
    assert ours[0]["local_numel"] == results["stage3"][0]["local_numel"]
    assert_same_run(ours, results["ddp"])


@pytest.mark.launch
def test_bf16_mixed_trains_in_bf16_close_to_fp32(results: dict[str, list[dict[str, Any]]]) -> None:
    ours, reference = results["stage2_bf16"][0], results["ddp"][0]
    assert {v.dtype for v in ours["weights"].values()} == {torch.bfloat16}  # DeepSpeed's bf16 section was added
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"][:6]), rtol=0, atol=1e-2)


@pytest.mark.launch
def test_stage3_shards_parameters_and_stages_1_2_do_not(results: dict[str, list[dict[str, Any]]]) -> None:
    for rank in results["stage3"]:
        assert rank["built_partitioned"] is True  # configure_model ran under deepspeed.zero.Init
        assert rank["local_numel"] <= math.ceil(rank["full_numel"] / 2) + 4  # 4 tensors, each rounded up
        assert rank["local_numel"] >= rank["full_numel"] / 2
    for stage in ("stage0", "stage1", "stage2"):
        assert all(r["local_numel"] == r["full_numel"] for r in results[stage])


@pytest.mark.launch
def test_micro_batch_and_train_batch_come_from_the_dataloader(results: dict[str, list[dict[str, Any]]]) -> None:
    rank0 = results["stage2"][0]
    assert (rank0["engine_micro_batch"], rank0["engine_accumulation"], rank0["engine_train_batch"]) == (8, 1, 16)


@pytest.mark.launch
def test_accumulation_and_clipping_match_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    ours, reference = results["stage2_accumulate"], results["ddp_accumulate"]
    # The plugin's accumulation (the Trainer left its default 1) and the Trainer's clipping (the plugin said 'auto').
    assert [(r["accumulate_grad_batches"], r["engine_accumulation"], r["engine_clipping"]) for r in ours] == [
        (4, 4, 0.05)
    ] * 2
    assert ours[0]["engine_train_batch"] == 8 * 4 * 2
    # 6 batches per epoch: one window of 4 and a shorter last one of 2, as under ddp.
    assert ours[0]["global_step"] == reference[0]["global_step"] == 4
    assert_same_run(ours, reference)


@pytest.mark.launch
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_continues_exactly(results: dict[str, list[dict[str, Any]]], stage: int) -> None:
    full, resumed = results[f"stage{stage}"], results[f"stage{stage}_resume"]
    for rank in (0, 1):
        assert full[rank]["saved_step"] == 6
        assert resumed[rank]["global_step"] == 12
        torch.testing.assert_close(
            torch.tensor(resumed[rank]["losses"]), torch.tensor(full[rank]["losses"][6:]), rtol=0, atol=1e-6
        )
        for key, value in resumed[rank]["weights"].items():
            torch.testing.assert_close(value, full[rank]["weights"][key], rtol=0, atol=1e-6)


@pytest.mark.launch
def test_fabric_stage3_matches_lightning_ddp(results: dict[str, list[dict[str, Any]]]) -> None:
    ours = results["fabric_stage3"]
    assert [r["strategy_class"] for r in ours] == ["FabricAcceleratedDeepSpeedStrategy"] * 2
    assert ours[0]["local_numel"] == results["stage3"][0]["local_numel"]
    # The weights are read after zeroing the shards and fabric.load-ing the checkpoint saved at the end.
    assert_same_run(ours, results["ddp"], prefix="net.")
    assert [r["loaded_remainder"] for r in ours] == [{"epochs": 2}] * 2


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["conflict_accumulation", "conflict_batch_size"])
def test_conflicts_raise_in_the_trainer(results: dict[str, list[dict[str, Any]]], variant: str) -> None:
    expected = {
        "conflict_accumulation": "gradient_accumulation_steps=4, but Trainer(accumulate_grad_batches=2)",
        "conflict_batch_size": "train_micro_batch_size_per_gpu=16, but the training DataLoader yields batches of 8",
    }[variant]
    for rank in results[variant]:
        assert rank["error_type"] == "ValueError", rank["error"]
        assert expected in rank["error"]


@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_consolidates_into_a_plain_module(
    run: tuple[dict[str, list[dict[str, Any]]], Path], stage: int
) -> None:
    results, out = run
    directory = out / f"stage{stage}.ckpt"
    # Stage 3 was saved with zero3_save_16bit_model=True (gathered weights); stages 0-2 only have DeepSpeed's files.
    assert (directory / "pytorch_model.bin").is_file() is (stage == 3)
    state = consolidate_deepspeed_checkpoint(directory)
    saved = results[f"stage{stage}"][0]["saved_weights"]
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    plain = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    plain.load_state_dict(consolidate_deepspeed_checkpoint(directory, prefix="net."), strict=True)
    torch.testing.assert_close(plain[0].weight, saved["net.0.weight"], rtol=0, atol=0)
    # The package-wide reader takes DeepSpeed directories as it takes acc_fsdp files and shard directories.
    again = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    again.load_state_dict(load_full_state_dict(directory, prefix="net."), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), plain.parameters(), strict=True))


@pytest.mark.launch
def test_fabric_checkpoint_consolidates(run: tuple[dict[str, list[dict[str, Any]]], Path]) -> None:
    results, out = run
    state = consolidate_deepspeed_checkpoint(out / "fabric_stage3.ckpt")
    for key, value in results["fabric_stage3"][0]["weights"].items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_consolidating_something_else_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"not a DeepSpeed checkpoint directory"):
        consolidate_deepspeed_checkpoint(tmp_path)


# --------------------------------------------------------------------------- one GPU


@pytest.mark.launch
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_stages_match_ddp_and_resume(tmp_path: Path) -> None:
    run_python([str(SCRIPTS / "deepspeed_gpu.py"), "--out", str(tmp_path)], timeout=600)
    found = {p.stem: torch.load(p, weights_only=False) for p in tmp_path.glob("*.pt")}
    reference = found["ddp"]
    for stage in (1, 2, 3):
        ours = found[f"stage{stage}"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5)
        for key, value in ours["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=0, atol=1e-5)
        resumed = found[f"stage{stage}_resume"]
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ours["losses"][6:]), rtol=0, atol=1e-6)


@pytest.mark.launch
def test_optimizer_and_scheduler_declared_in_the_config(results: dict[str, list[dict[str, Any]]]) -> None:
    rank0 = results["declared_optimizer"][0]
    assert rank0["basic_optimizer"] == "AdamW"  # built by DeepSpeed from the config, not configure_optimizers' SGD
    assert all(math.isfinite(loss) for loss in rank0["losses"])
    lrs = rank0["lrs"]
    # warmup_max_lr came from configure_optimizers (0.5); Lightning steps the scheduler once per optimizer step.
    assert lrs == sorted(lrs)
    assert lrs[0] < 0.5 and lrs[-1] == 0.5
    assert len(set(lrs)) >= 4
