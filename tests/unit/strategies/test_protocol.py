"""``ShimStrategy``: what the Accelerator asks of a Fabric strategy, answered by every ``acc_*`` strategy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn

import lightning_accel
import lightning_accel._accelerator.fabric as shim_fabric
from lightning_accel.lightning_compat import lightning_private
from lightning_accel.strategies.ddp import FabricAcceleratedDDPStrategy
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy
from lightning_accel.strategies.protocol import ShimStrategy, ShimStrategyDefaults, as_shim_strategy
from lightning_accel.strategies.registry import entries
from lightning_accel.strategies.single_device import FabricAcceleratedSingleDeviceStrategy
from lightning_accel.utils import DeepSpeedPlugin

PACKAGE = Path(lightning_accel.__file__).parent
# The checkpoint files of the shim belong to the checkpoint package's work (their engine table included).
_CHECKPOINT_FILES = {"checkpoints.py", "checkpoint_publish.py", "sharded_checkpoint.py", "loader_checkpoint.py"}
_PROBE = re.compile(r"isinstance\([^)]*[Ss]trateg|getattr\([^)]*strateg|hasattr\([^)]*strateg")


@pytest.mark.parametrize("entry", entries(), ids=lambda entry: entry.name)
def test_every_registered_fabric_strategy_answers_the_protocol(entry: object) -> None:
    fabric_cls = entry.fabric_cls  # type: ignore[attr-defined]
    assert issubclass(fabric_cls, ShimStrategyDefaults)
    members = {name for name in vars(ShimStrategy) if not name.startswith("_")} | set(ShimStrategy.__annotations__)
    assert {"engine_steps_in_backward", "configure_from_prepare", "step_boundary", "checkpoint_engine"} <= members
    missing = sorted(member for member in members if not hasattr(fabric_cls, member))
    assert missing == []


def test_a_strategy_outside_the_protocol_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"got DDPStrategy: add ShimStrategyDefaults"):
        as_shim_strategy(DDPStrategy())


def test_the_defaults_do_nothing() -> None:
    strategy = as_shim_strategy(FabricAcceleratedSingleDeviceStrategy(device=torch.device("cpu")))
    model = nn.Linear(2, 2)
    with strategy.step_boundary(False):
        pass
    assert not strategy.engine_steps_in_backward and not strategy.marks_step_boundary
    assert not strategy.joins_uneven_inputs
    assert strategy.step_engine() is None and strategy.checkpoint_engine() is None
    assert strategy.data_parallel_shards() is None
    assert strategy.mesh_rank("tp") == 0
    assert strategy.returned_model(model) is model
    assert strategy.fsdp_plugin is None and strategy.parallelism_config is None and strategy.torch_device_mesh is None


def test_ddp_shards_data_over_its_process_group_and_joins_uneven_inputs() -> None:
    strategy = as_shim_strategy(FabricAcceleratedDDPStrategy(parallel_devices=[torch.device("cpu")] * 2))
    assert strategy.data_parallel_shards() == (2, 0)
    assert strategy.joins_uneven_inputs


def test_deepspeed_says_its_engine_steps_in_backward_under_one_name_for_the_step_boundary() -> None:
    fabric_strategy = FabricAcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=2))
    trainer_strategy = AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=2))
    assert fabric_strategy.engine_steps_in_backward and fabric_strategy.marks_step_boundary
    assert trainer_strategy.marks_step_boundary
    assert fabric_strategy.step_engine() is None  # no engine before a model is set up
    control = lightning_private(fabric_strategy, "_backward_sync_control")
    assert not hasattr(control, "marks_step_boundary")
    assert not hasattr(trainer_strategy, "block_backward_sync_marks_step_boundary")


def test_the_accelerator_reads_the_strategy_through_the_protocol() -> None:
    accelerator = lightning_accel.Accelerator(cpu=True)
    assert accelerator._strategy is accelerator.fabric.strategy
    assert isinstance(accelerator._strategy, ShimStrategyDefaults)


def test_the_shim_does_not_branch_on_strategy_classes() -> None:
    files = [PACKAGE / "accelerator.py", PACKAGE / "optimizer.py", PACKAGE / "scheduler.py"]
    files += [p for p in (PACKAGE / "_accelerator").glob("*.py") if p.name not in _CHECKPOINT_FILES]
    files += sorted(PACKAGE.glob("data_loader*.py")) + sorted((PACKAGE / "data_loader").glob("*.py"))
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = re.sub(r"isinstance\(precision[^)]*\)", "", line)  # a precision check that names a strategy later
            if _PROBE.search(code):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert found == []
    assert not hasattr(shim_fabric, "_PREPARED_STRATEGIES")
