"""``acc_fsdp`` on CPU: 2 processes (gloo) against Lightning's ``ddp``, plus single-process checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_accel
from lightning_accel.strategies import AcceleratedFSDPStrategy, FabricAcceleratedFSDPStrategy
from lightning_accel.utils import DistributedType, FullyShardedDataParallelPlugin, load_full_state_dict
from tests.helpers import load_rank_results, torchrun

TRAINER_VARIANTS = ["fsdp2", "fsdp2_units", "fsdp1"]
# FSDP units (the root included) and activation-checkpointed blocks each configuration must produce.
STRUCTURE = {
    "fsdp2": (1, 0),
    # size_based_wrap(min_num_params=100), counting all of a module's parameters as Accelerate 1.15's FSDP2 policy
    # does: Linear(16, 64) (1088) and the Sequential holding it (1153) are units, Linear(64, 1) (65) is not.
    "fsdp2_units": (3, 0),
    "fsdp1": (1, 0),
    # transformer_based_wrap on "Linear" + activation checkpointing of both Linears: as in Accelerate 1.15, each Linear
    # and the checkpoint wrapper around it are units (the policy looks through the wrapper).
    "fsdp2_options": (5, 2),
    "fsdp1_options": (2, 0),
}
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, Path]:
    out = tmp_path_factory.mktemp("fsdp_parity")
    torchrun("fsdp_parity.py", "--out", str(out), timeout=400)
    found = load_rank_results(out)
    return found, out


def assert_close_runs(ours: list[dict[str, Any]], reference: list[dict[str, Any]], last: int | None = None) -> None:
    for rank, (a, b) in enumerate(zip(ours, reference, strict=True)):
        expected = b["losses"] if last is None else b["losses"][-last:]
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(expected), rtol=0, atol=1e-5)
        assert a["weights"].keys() == b["weights"].keys()
        for key, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][key], rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.launch
@pytest.mark.parametrize("variant", list(STRUCTURE))
def test_trainer_matches_ddp_and_shards_parameters(run: tuple[Results, Path], variant: str) -> None:
    results, _ = run
    ours = results[variant]
    assert (ours[0]["fsdp_units"], ours[0]["checkpoint_wrappers"]) == STRUCTURE[variant]
    assert len(ours[0]["losses"]) == 12
    assert {r["strategy_class"] for r in ours} == {"AcceleratedFSDPStrategy"}
    assert {r["distributed_type"] for r in ours} == {"DistributedType.FSDP"}
    assert_close_runs(ours, results["ddp"])
    # Each of the 2 processes holds about half of the 1153 parameter elements (FSDP pads the last shard).
    fractions = [r["local_fraction"] for r in ours]
    assert all(0.4 < f < 0.6 for f in fractions), fractions
    assert results["ddp"][0]["local_fraction"] == 1.0


@pytest.mark.launch
def test_fsdp1_sync_module_states_gives_every_rank_rank_0s_weights(run: tuple[Results, Path]) -> None:
    """fsdp1_options starts rank 1 from other weights; with sync_module_states, rank 0's are on every rank.

    (test_trainer_matches_ddp_and_shards_parameters then checks that the run trains like ddp from rank 0's start.)
    """
    results, _ = run
    rank0, rank1 = results["fsdp1_options"]
    assert rank0["initial_weights"].keys() == rank1["initial_weights"].keys()
    for key, value in rank0["initial_weights"].items():
        assert not torch.equal(rank1["initial_weights"][key], value), key  # the ranks really started apart
    for rank in (rank0, rank1):
        assert rank["weights_at_train_start"].keys() == rank0["initial_weights"].keys()
        for key, value in rank0["initial_weights"].items():
            assert torch.equal(rank["weights_at_train_start"][key], value), key


@pytest.mark.launch
@pytest.mark.parametrize("variant", TRAINER_VARIANTS)
def test_accumulation_matches_ddp(run: tuple[Results, Path], variant: str) -> None:
    results, _ = run
    assert_close_runs(results[f"{variant}_accum"], results["ddp_accum"])
    # Accumulating really changed the run (otherwise this test could not fail).
    assert results["ddp_accum"][0]["losses"][3:] != results["ddp"][0]["losses"][3:]


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["fsdp2_resume", "fsdp1_resume"])
def test_save_and_resume_continues_exactly(run: tuple[Results, Path], variant: str) -> None:
    results, _ = run
    ours = results[variant]
    for rank in (0, 1):
        assert ours[rank]["first_losses"] == results["ddp"][rank]["losses"][:6]
    # The resumed run trains epoch 2 only, with the restored weights and momentum: exactly the uninterrupted run.
    assert_close_runs(ours, results["ddp"], last=6)


@pytest.mark.launch
def test_checkpoint_formats_on_disk(run: tuple[Results, Path]) -> None:
    _, out = run
    sharded, full = out / "fsdp2_resume.ckpt", out / "fsdp1_resume.ckpt"
    assert sharded.is_dir()
    assert (sharded / "meta.pt").is_file()
    assert (sharded / ".metadata").is_file()
    assert full.is_file()
    checkpoint = torch.load(full, weights_only=False)
    assert checkpoint["epoch"] == 1  # saved after max_epochs=1 finished
    assert set(checkpoint["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert checkpoint["state_dict"]["net.0.weight"].shape == (64, 16)


@pytest.mark.launch
@pytest.mark.parametrize("name", ["fsdp2_resume.ckpt", "fsdp1_resume.ckpt", "fabric_fsdp2.ckpt"])
def test_full_state_dict_loads_into_a_plain_module(run: tuple[Results, Path], name: str) -> None:
    results, out = run
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    variant = name.removesuffix(".ckpt")
    if variant.startswith("fabric"):
        net.load_state_dict(load_full_state_dict(out / name, key="model"))
        expected = results[variant][0]["weights"]
    else:  # a LightningModule's keys carry its attribute name
        net.load_state_dict(load_full_state_dict(out / name, prefix="net."))
        expected = results[variant][0]["saved_weights"]
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)


def test_load_full_state_dict_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        load_full_state_dict(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {"net.w": torch.zeros(1)}}, tmp_path / "c.ckpt")
    with pytest.raises(KeyError, match=r"prefix 'model\.'.*'net.w'"):
        load_full_state_dict(tmp_path / "c.ckpt", prefix="model.")
    with pytest.raises(KeyError, match=r"no 'model' entry; pass `key=`.*'state_dict'"):
        load_full_state_dict(tmp_path / "c.ckpt", key="model")


@pytest.mark.launch
@pytest.mark.parametrize("variant", ["fabric_fsdp2", "fabric_fsdp1"])
def test_fabric_matches_ddp_and_round_trips_checkpoints(run: tuple[Results, Path], variant: str) -> None:
    results, _ = run
    ours = results[variant]
    assert_close_runs(ours, results["fabric_ddp"])
    for rank in ours:
        assert rank["reloaded_step"] == 12
        assert rank["momentum_restored"]
        for key, value in rank["weights"].items():
            assert torch.equal(value, rank["reloaded_weights"][key]), key
        # The script sets up a network with an optimizer built from another one: the one-call setup names the tensor.
        assert "is not a parameter of the Sequential set up with it" in rank["setup_error"]


def test_acc_fsdp_is_registered_and_accepted_on_cpu() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="acc_fsdp", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, AcceleratedFSDPStrategy)
    assert trainer.strategy.distributed_type is DistributedType.FSDP
    assert trainer.strategy.fsdp_plugin.fsdp_version == 2
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="acc_fsdp")
    assert isinstance(fabric.strategy, FabricAcceleratedFSDPStrategy)
    built = lightning_accel.strategy_for(
        DistributedType.FSDP, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)
    )
    assert isinstance(built, AcceleratedFSDPStrategy)
    assert built.fsdp_plugin.fsdp_version == 1


def test_bad_plugin_type_is_refused() -> None:
    with pytest.raises(TypeError, match="`fsdp_plugin` must be a FullyShardedDataParallelPlugin, got dict"):
        AcceleratedFSDPStrategy({"fsdp_version": 2})  # type: ignore[arg-type]


def test_cpu_offload_on_cpu_and_checkpointing_without_blocks_are_refused() -> None:
    from lightning_accel.strategies.fsdp_core import FSDPFamily

    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"cpu_offload=\.\.\.\) moves parameters .* already trains on CPU"):
        FSDPFamily(FullyShardedDataParallelPlugin(cpu_offload=True)).wrap(net, torch.device("cpu"), 1)
    plugin = FullyShardedDataParallelPlugin(activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"activation_checkpointing=True needs .*transformer_cls_names_to_wrap"):
        FSDPFamily(plugin).wrap(net, torch.device("cpu"), 1)
