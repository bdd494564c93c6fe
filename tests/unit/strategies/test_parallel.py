"""``acc_parallel`` on CPU (gloo): tp=2 on 2 processes, dp_shard=2 x tp=2 on 4, against one process; plus checks.

The multi-process runs (``tests/scripts/parallel_parity.py``) train the same MLP with the Trainer (tensor parallelism
from ``configure_model`` and from ``tp_plan``, a sharded checkpoint and resume) and with Fabric (``parallelize_fn``,
one-call ``setup``, save/load), and compare with plain PyTorch on the global batch in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_accel
from lightning_accel.config.file import AccelerateConfig, load_config, parallelism_config_from_section
from lightning_accel.strategies import AcceleratedParallelStrategy, FabricAcceleratedParallelStrategy
from lightning_accel.strategies.parallel_core import ParallelFamily
from lightning_accel.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    load_full_state_dict,
)
from tests.helpers import ACCELERATE_CONFIGS, load_rank_results, torchrun

Results = dict[str, list[dict[str, Any]]]
ATOL = 1e-5


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, Path]:
    out = tmp_path_factory.mktemp("parallel_2")
    torchrun("parallel_parity.py", "--out", str(out), "--layout", "2", nproc=2, timeout=300)
    return load_rank_results(out), out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, Path]:
    out = tmp_path_factory.mktemp("parallel_4")
    torchrun("parallel_parity.py", "--out", str(out), "--layout", "4", nproc=4, timeout=480)
    return load_rank_results(out), out


def assert_matches_reference(ours: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Every rank's dp-averaged losses and full weights equal the single-process run's (its last steps on resume)."""
    for rank, result in enumerate(ours):
        expected = reference["losses"][-len(result["losses"]) :]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=0, atol=ATOL)
        assert result["weights"].keys() == reference["weights"].keys()
        for key, value in result["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=0, atol=ATOL, msg=f"rank {rank} {key}")


@pytest.mark.launch
@pytest.mark.parametrize(("variant", "steps"), [("tp", 16), ("tp_resume", 8), ("fabric_tp", 16), ("replicate", 8)])
def test_two_processes_match_one(two: tuple[Results, Path], variant: str, steps: int) -> None:
    results, _ = two
    assert len(results[variant]) == 2 and len(results[variant][0]["losses"]) == steps
    assert_matches_reference(results[variant], results[f"reference_{variant.removesuffix('_resume')}"][0])


@pytest.mark.launch
@pytest.mark.parametrize(
    ("variant", "steps"),
    [("dp_shard_tp", 8), ("dp_shard_tp_resume", 4), ("fabric_dp_shard_tp", 8), ("hsdp", 4)],
)
def test_four_processes_match_one(four: tuple[Results, Path], variant: str, steps: int) -> None:
    results, _ = four
    assert len(results[variant]) == 4 and len(results[variant][0]["losses"]) == steps
    assert_matches_reference(results[variant], results[f"reference_{variant.removesuffix('_resume')}"][0])


@pytest.mark.launch
def test_tp_mesh_ranks_and_placements(two: tuple[Results, Path]) -> None:
    results, _ = two
    for variant in ("tp", "tp_resume", "fabric_tp"):
        for rank, result in enumerate(results[variant]):
            assert result["mesh_dims"] == ("tp",) and result["mesh_shape"] == (2,)
            assert result["placements"] == ["S(0)"]  # ColwiseParallel: w1.weight split by rows over tp
            assert result["local_numel"] == 16 * 8 // 2
            assert result["ranks"] == {"tp": rank, "dp_shard": 0, "dp_replicate": 0, "cp": 0}
            assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # both tp ranks see the same batch
            assert result["fsdp_units"] == 0  # nothing to shard over
            assert result["distributed_type"] == "DistributedType.MULTI_CPU"  # Accelerate's type for tp alone
    for rank, result in enumerate(results["replicate"]):
        assert result["mesh_dims"] == ("dp_replicate",)
        assert result["placements"] == ["R", "S(0)"]  # HSDP over (dp_replicate, dp_shard_cp=1): replicated
        assert result["sampler"] == {"num_replicas": 2, "rank": rank}
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"


@pytest.mark.launch
def test_dp_shard_tp_mesh_ranks_and_placements(four: tuple[Results, Path]) -> None:
    results, _ = four
    for variant in ("dp_shard_tp", "dp_shard_tp_resume", "fabric_dp_shard_tp"):
        for rank, result in enumerate(results[variant]):
            assert result["mesh_dims"] == ("dp_shard", "tp") and result["mesh_shape"] == (2, 2)
            # FSDP2 shards the tp shard's rows again over dp_shard: a quarter of w1.weight per process.
            assert result["placements"] == ["_S(0, 2)", "S(0)"]
            assert result["local_numel"] == 16 * 8 // 4
            assert result["ranks"] == {"tp": rank % 2, "dp_shard": rank // 2, "dp_replicate": 0, "cp": 0}
            assert result["sampler"] == {"num_replicas": 2, "rank": rank // 2}
            assert result["fsdp_units"] == 1
    for rank, result in enumerate(results["hsdp"]):
        assert result["mesh_dims"] == ("dp_replicate", "dp_shard")
        assert result["placements"] == ["R", "S(0)"]
        assert result["ranks"] == {"tp": 0, "dp_shard": rank % 2, "dp_replicate": rank // 2, "cp": 0}
        assert result["sampler"] == {"num_replicas": 4, "rank": rank}


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["two", "four"])
def test_sharded_checkpoints_resume_exactly(layout: str, request: pytest.FixtureRequest) -> None:
    results, out = request.getfixturevalue(layout)
    name = "tp" if layout == "two" else "dp_shard_tp"
    reference = results[f"reference_{name}"][0]["losses"]
    for result in results[f"{name}_resume"]:
        first = result["first_losses"]
        torch.testing.assert_close(torch.tensor(first), torch.tensor(reference[: len(first)]), rtol=0, atol=ATOL)
    checkpoint = out / f"{name}_resume.ckpt"
    assert (checkpoint / "meta.pt").is_file() and (checkpoint / ".metadata").is_file()
    assert len(list(checkpoint.glob("*.distcp"))) == (2 if layout == "two" else 4)
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["epoch"] == 1  # saved after max_epochs=1


@pytest.mark.parametrize(("layout", "variant"), [("two", "fabric_tp"), ("four", "fabric_dp_shard_tp")])
@pytest.mark.launch
def test_fabric_checkpoint_round_trip(layout: str, variant: str, request: pytest.FixtureRequest) -> None:
    results, out = request.getfixturevalue(layout)
    assert (out / f"{variant}.ckpt" / "meta.pt").is_file()
    for result in results[variant]:
        assert result["reloaded_step"] == len(result["losses"])
        assert result["momentum_restored"]
        for key, value in result["weights"].items():
            assert torch.equal(value, result["reloaded_weights"][key]), key


@pytest.mark.launch
def test_checkpoints_load_into_a_plain_module(two: tuple[Results, Path]) -> None:
    """The sharded Trainer directory and the full Fabric file both hold the full weights of the plain MLP."""
    from tests.scripts.parallel_parity import MLP

    results, out = two
    for name, prefix, key, expected in (
        ("tp_resume.ckpt", "net.", "state_dict", None),
        ("fabric_tp_full.ckpt", "", "model", results["fabric_tp_full"][0]["weights"]),
    ):
        plain = MLP()
        plain.load_state_dict(load_full_state_dict(out / name, prefix=prefix, key=key))
        if expected is not None:
            for k, v in plain.state_dict().items():
                assert torch.equal(v, expected[k]), k
    assert (out / "fabric_tp_full.ckpt").is_file()
    for result in results["fabric_tp_full"]:
        for k, v in result["weights"].items():
            assert torch.equal(v, result["reloaded_weights"][k]), k


@pytest.mark.launch
def test_tensor_parallel_without_a_plan_is_refused(two: tuple[Results, Path]) -> None:
    results, _ = two
    for result in results["missing_plan"]:
        assert "tp_size=2, but no parameter of MLP is split over the 'tp' mesh dimension" in result["error"]


def test_registered_for_trainer_and_fabric() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="acc_parallel", logger=False)
    assert isinstance(trainer.strategy, AcceleratedParallelStrategy)
    # An all-ones config replicates over the processes, as Accelerate does.
    assert trainer.strategy.parallelism_config.dp_replicate_size == 2
    assert trainer.strategy.distributed_type is DistributedType.MULTI_CPU
    assert trainer.strategy.torch_device_mesh is None  # built when the processes start
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="acc_parallel")
    assert isinstance(fabric.strategy, FabricAcceleratedParallelStrategy)
    assert "acc_parallel" in {entry.name for entry in lightning_accel.strategies.entries()}


def test_the_callers_config_is_not_changed() -> None:
    config = ParallelismConfig()
    strategy = AcceleratedParallelStrategy(config)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert config.dp_replicate_size == 1 and strategy.parallelism_config.dp_replicate_size == 2


def test_sizes_must_multiply_to_the_process_count() -> None:
    strategy = AcceleratedParallelStrategy(ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match=r"total_size \(4 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 2\).* 2 processes"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match=r"total_size \(2 .*\) does not match the 3 processes"):
        L.Fabric(accelerator="cpu", devices=3, strategy=FabricAcceleratedParallelStrategy(ParallelismConfig(tp_size=2)))


@pytest.mark.parametrize("fabric", [False, True])
def test_context_parallel_on_cpu_is_refused(fabric: bool) -> None:
    """torch's ``context_parallel`` has no CPU path (checked on torch 2.13 with gloo): refuse it when Lightning
    picks the devices, before any process starts."""
    config = ParallelismConfig(dp_shard_size=1, cp_size=2)
    pattern = r"cp_size=2 needs GPUs: torch's context_parallel \(ring attention\) has no CPU kernel.*Set cp_size=1"
    with pytest.raises(ValueError, match=pattern):
        if fabric:
            L.Fabric(accelerator="cpu", devices=2, strategy=FabricAcceleratedParallelStrategy(config))
        else:
            L.Trainer(accelerator="cpu", devices=2, strategy=AcceleratedParallelStrategy(config), logger=False)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="`parallelism_config` must be a ParallelismConfig, got dict"):
        ParallelFamily({"tp_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fsdp_version=1; set FullyShardedDataParallelPlugin\(fsdp_version=2\)"):
        AcceleratedParallelStrategy(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    with pytest.raises(ValueError, match=r"sequence parallelism \(sp_size=2\); set sp_size=1"):
        AcceleratedParallelStrategy(ParallelismConfig(sp_size=2))
    with pytest.raises(TypeError, match="`tp_plan` must map submodule names to ParallelStyles, got list"):
        AcceleratedParallelStrategy(tp_plan=["w1"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`parallelize_fn` must be callable"):
        FabricAcceleratedParallelStrategy(parallelize_fn="w1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown mesh dimension 'pp'"):
        ParallelFamily().rank("pp")


def test_ranks_are_zero_before_the_mesh_exists() -> None:
    strategy = AcceleratedParallelStrategy(ParallelismConfig(tp_size=2))
    assert (strategy.tensor_parallel_rank, strategy.data_parallel_rank, strategy.data_parallel_shard_rank) == (0, 0, 0)
    assert strategy.context_parallel_rank == 0
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.fsdp_plugin.fsdp_version == 2


FILES = ACCELERATE_CONFIGS


def test_config_file_section_becomes_a_parallelism_config() -> None:
    built = load_config(FILES / "parallelism.yaml").build_parallelism_config()
    assert isinstance(built, ParallelismConfig)
    assert (built.dp_replicate_size, built.dp_shard_size, built.tp_size, built.cp_size) == (1, 2, 2, 1)
    assert built._get_mesh() == (("dp_shard", "tp"), (2, 2))
    assert load_config(FILES / "parallelism.yaml").parallelism_config == {  # the section itself stays data
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
    }


def test_config_file_context_parallel_keys_fill_the_handler() -> None:
    section = {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_cp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall",
    }
    built = AccelerateConfig.from_dict(
        {
            "distributed_type": "FSDP",
            "num_processes": 8,
            "fsdp_config": {"fsdp_version": 2},
            "parallelism_config": section,
        }
    ).build_parallelism_config()
    assert built is not None and built.cp_handler is not None
    assert built.cp_handler.cp_comm_strategy == "alltoall"
    assert built._get_mesh() == (("dp_replicate", "dp_shard", "cp"), (2, 2, 2))
    assert parallelism_config_from_section({}) is None


def test_config_file_contradictions_are_refused_when_read() -> None:
    section = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_tp_size": 2}
    with pytest.raises(ValueError, match=r"^parallelism_config: Tensor/context parallelism does not compose"):
        AccelerateConfig.from_dict({"distributed_type": "FSDP", "num_processes": 4, "parallelism_config": section})
