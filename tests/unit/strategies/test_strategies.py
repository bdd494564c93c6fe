"""Registration, selection and error handling of the DDP-family strategies (one process, no launch)."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel
from lightning_accel.strategies import (
    AcceleratedDDPStrategy,
    AcceleratedSingleDeviceStrategy,
    FabricAcceleratedDDPStrategy,
    FabricAcceleratedSingleDeviceStrategy,
    entries,
    strategy_for,
)
from lightning_accel.strategies.lightning_arguments import keyword_names, takes_any_keyword
from lightning_accel.strategies.registry import StrategyEntry
from lightning_accel.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from tests.helpers import run_python

DDP_NAMES = [
    "acc_multi_cpu",
    "acc_multi_gpu",
    "acc_multi_npu",
    "acc_multi_xpu",
    "acc_multi_hpu",
    "acc_multi_mlu",
    "acc_multi_musa",
    "acc_multi_sdaa",
    "acc_multi_neuron",
    "acc_ddp",
]
# Device extensions that this CPU machine lacks, and the words the error must contain.
MISSING_EXTENSIONS = {
    "acc_multi_npu": "torch_npu",
    "acc_multi_hpu": "habana_frameworks.torch",
    "acc_multi_mlu": "torch_mlu",
    "acc_multi_musa": "torch_musa",
    "acc_multi_sdaa": "torch_sdaa",
    "acc_multi_neuron": "torch_neuronx",
    "acc_multi_xpu": "torch build with xpu support",
}
TRAINER_FLAGS = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


@pytest.mark.launch
def test_import_registers_every_name_in_both_registries_and_loads_no_optional_backend() -> None:
    code = (
        "import json, sys, lightning_accel\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "heavy = ['deepspeed', 'wandb', 'torchao', 'transformer_engine', 'torch_xla', 'megatron']\n"
        "print(json.dumps({'loaded': [m for m in heavy if m in sys.modules],"
        " 'trainer': StrategyRegistry.available_strategies(), 'fabric': STRATEGY_REGISTRY.available_strategies()}))"
    )
    report = json.loads(run_python(["-c", code], timeout=120).stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    for name in ["acc_no", *DDP_NAMES]:
        assert name in report["trainer"], name
        assert name in report["fabric"], name


def test_entries_cover_no_and_every_ddp_family_type() -> None:
    names = {e.name for e in entries()}
    assert names >= {"acc_no", *DDP_NAMES}
    types = {e.distributed_type for e in entries() if e.distributed_type is not None}
    assert DistributedType.NO in types
    assert DistributedType.MULTI_NEURON in types
    for entry in entries():
        assert StrategyRegistry[entry.name]["strategy"] is entry.trainer_cls
        assert FABRIC_REGISTRY[entry.name]["strategy"] is entry.fabric_cls


def test_trainer_with_default_flags_accepts_acc_multi_cpu() -> None:
    trainer = L.Trainer(strategy="acc_multi_cpu", **TRAINER_FLAGS)
    assert isinstance(trainer.strategy, AcceleratedDDPStrategy)
    assert trainer.strategy.distributed_type is DistributedType.MULTI_CPU
    assert trainer.strategy._get_process_group_backend() == "gloo"


@pytest.mark.parametrize("name", ["acc_ddp", "acc_multi_cpu"])
def test_ddp_names_resolve_to_multi_cpu_on_cpu(name: str) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, **TRAINER_FLAGS)
    assert trainer.strategy.distributed_type is DistributedType.MULTI_CPU
    assert trainer.strategy.num_processes == 2
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
    assert isinstance(fabric.strategy, FabricAcceleratedDDPStrategy)
    assert fabric.strategy.distributed_type is DistributedType.MULTI_CPU


def test_acc_no_takes_the_device_the_accelerator_selects() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="acc_no", **TRAINER_FLAGS)
    assert isinstance(trainer.strategy, AcceleratedSingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.distributed_type is DistributedType.NO
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_no")
    assert isinstance(fabric.strategy, FabricAcceleratedSingleDeviceStrategy)
    assert fabric.device == torch.device("cpu")


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_acc_no_refuses_several_devices(make: type) -> None:
    with pytest.raises(ValueError, match=r"'acc_no' trains one process on one device, but 2 devices.*acc_ddp"):
        make(accelerator="cpu", devices=2, strategy="acc_no")


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_gpu_strategy_on_cpu_accelerator_names_the_fix(make: type) -> None:
    with pytest.raises(ValueError, match=r"'acc_multi_gpu' trains on 'cuda' devices.*gives 'cpu'.*accelerator='gpu'"):
        make(accelerator="cpu", devices=2, strategy="acc_multi_gpu")


@pytest.mark.parametrize(("name", "package"), sorted(MISSING_EXTENSIONS.items()))
@pytest.mark.parametrize("make", [L.Trainer, L.Fabric])
def test_missing_device_extension_names_the_package(make: type, name: str, package: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=rf"{name}.*{package}.*Install it"):
        make(strategy=name)


def test_strategy_for_builds_trainer_and_fabric_strategies() -> None:
    kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    trainer_strategy = strategy_for(DistributedType.MULTI_CPU, ddp_kwargs=kwargs)
    assert isinstance(trainer_strategy, AcceleratedDDPStrategy)
    assert trainer_strategy.distributed_type is DistributedType.MULTI_CPU
    assert trainer_strategy._ddp_kwargs == {"find_unused_parameters": True}
    fabric_strategy = strategy_for("multi_cpu", fabric=True)
    assert isinstance(fabric_strategy, FabricAcceleratedDDPStrategy)
    assert isinstance(strategy_for("NO"), AcceleratedSingleDeviceStrategy)
    assert isinstance(strategy_for("NO", fabric=True), FabricAcceleratedSingleDeviceStrategy)
    assert lightning_accel.strategy_for is strategy_for


def test_strategy_for_builds_every_type_and_refuses_unknown_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown distributed type 'MULTI_TPU'.*MULTI_CPU"):
        strategy_for("MULTI_TPU")
    assert len(DistributedType) == 14
    built = set()
    for dtype in DistributedType:
        for fabric in (False, True):
            try:
                strategy = strategy_for(dtype, fabric=fabric)
            except ModuleNotFoundError as err:  # a vendor extension or torch_xla that is not installed here
                assert re.search(r"[Ii]nstall", str(err)), (dtype, err)
                continue
            assert strategy.distributed_type in (dtype, None), (dtype, fabric)  # None: derived from the devices
            built.add(dtype)
    expected = {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM"}  # their packages are installed
    assert expected <= {dtype.value for dtype in built}


def test_strategy_passes_ddp_and_process_group_options() -> None:
    strategy = AcceleratedDDPStrategy(
        "MULTI_CPU",
        ddp_kwargs=DistributedDataParallelKwargs(bucket_cap_mb=5, static_graph=True, comm_hook="fp16"),
        init_kwargs=InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=42)),
    )
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 5, "static_graph": True}
    assert strategy._timeout == timedelta(seconds=42)
    fabric = FabricAcceleratedDDPStrategy("MULTI_CPU", init_kwargs=InitProcessGroupKwargs(timeout=timedelta(seconds=7)))
    assert fabric._timeout == timedelta(seconds=7)


def test_bf16_comm_hook_on_cpu_is_refused_at_construction() -> None:
    strategy = AcceleratedDDPStrategy("MULTI_CPU", ddp_kwargs=DistributedDataParallelKwargs(comm_hook="bf16"))
    with pytest.raises(ValueError, match=r"comm_hook/comm_wrapper='bf16'.*NCCL.*Use 'fp16' or 'power_sgd' on CPU"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **TRAINER_FLAGS)


def test_gpu_collective_on_cpu_is_refused() -> None:
    strategy = AcceleratedDDPStrategy("MULTI_CPU", init_kwargs=InitProcessGroupKwargs(backend="hccl"))
    with pytest.raises(ValueError, match=r"backend='hccl'\) cannot run on CPU.*gloo"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **TRAINER_FLAGS)


def test_wrong_argument_types_and_values_are_refused() -> None:
    with pytest.raises(TypeError, match=r"`ddp_kwargs` must be a DistributedDataParallelKwargs, got dict"):
        AcceleratedDDPStrategy("MULTI_CPU", ddp_kwargs={"bucket_cap_mb": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`init_kwargs` must be a InitProcessGroupKwargs, got str"):
        FabricAcceleratedDDPStrategy("MULTI_CPU", init_kwargs="gloo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Unknown distributed_type 'MULTI_TPU'"):
        AcceleratedDDPStrategy("MULTI_TPU")
    with pytest.raises(ValueError, match=r"DistributedType.FSDP is not a data-parallel device type"):
        AcceleratedDDPStrategy(DistributedType.FSDP)


# Each side's own arguments: Lightning's precision plugin is `precision_plugin` on the Trainer and `precision` in
# Fabric; Fabric's DeepSpeed takes the loop's accumulation and Fabric's ModelParallelStrategy a parallelize_fn.
_TRAINER_ONLY = {"precision_plugin"}
_FABRIC_ONLY = {"precision", "gradient_accumulation_steps", "parallelize_fn"}
_TYPED = [e for e in entries() if not takes_any_keyword(e.trainer_cls)]  # acc_xla keeps Lightning's open **kwargs


@pytest.mark.parametrize("entry", _TYPED, ids=lambda e: e.name)
def test_trainer_and_fabric_twins_take_the_same_settings(entry: StrategyEntry) -> None:
    trainer, fabric = keyword_names(entry.trainer_cls), keyword_names(entry.fabric_cls)
    assert "strategy_name" in trainer
    assert trainer - _TRAINER_ONLY == fabric - _FABRIC_ONLY
    # acc_parallel follows Lightning's ModelParallelStrategy, which takes no accelerator or precision plugin.
    lightning_plugins = {"accelerator", "precision_plugin"} if entry.name != "acc_parallel" else set()
    assert trainer & {"accelerator", "precision_plugin"} == lightning_plugins


def test_keyword_names_are_the_declared_ones() -> None:
    assert keyword_names(AcceleratedDDPStrategy) == {
        "distributed_type",
        "ddp_kwargs",
        "init_kwargs",
        "dynamo_plugin",
        "strategy_name",
        "checkpoint_io",
        "start_method",
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "precision_plugin",
    }


@pytest.mark.parametrize("side", ["trainer_cls", "fabric_cls"])
@pytest.mark.parametrize("entry", [e for e in _TYPED if e.name in ("acc_no", "acc_ddp", "acc_fsdp", "acc_parallel")])
def test_an_unknown_or_other_side_keyword_is_refused_by_name(entry: StrategyEntry, side: str) -> None:
    cls = getattr(entry, side)
    with pytest.raises(
        TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword argument 'bucket_cap_mb'; it takes "
    ):
        cls(bucket_cap_mb=5)
    other = "precision" if side == "trainer_cls" else "precision_plugin"
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{other}'"):
        cls(**{other: None})


def test_a_subclass_key_of_the_ddp_family_is_refused_by_its_sibling() -> None:
    """``acc_fsdp`` extends the DDP strategy but does not take its ``ddp_kwargs``; Megatron-LM takes no dynamo."""
    from lightning_accel.strategies.fsdp import AcceleratedFSDPStrategy

    with pytest.raises(TypeError, match=r"AcceleratedFSDPStrategy\(\) got an unexpected keyword argument 'ddp_kwargs'"):
        AcceleratedFSDPStrategy(ddp_kwargs=DistributedDataParallelKwargs())
    assert "ddp_kwargs" not in keyword_names(AcceleratedFSDPStrategy)


def test_a_user_subclass_passing_plain_kwargs_on_keeps_the_parent_keywords_and_refusal() -> None:
    """A subclass as Lightning users write them: its own argument, the rest forwarded as plain ``**kwargs``."""

    class LabelledDDP(AcceleratedDDPStrategy):
        def __init__(self, label: str = "run", **kwargs: Any) -> None:
            self.label = label
            super().__init__(**kwargs)

    strategy = LabelledDDP("mine", ddp_kwargs=DistributedDataParallelKwargs(bucket_cap_mb=5))
    assert (strategy.label, strategy._ddp_kwargs["bucket_cap_mb"]) == ("mine", 5)
    with pytest.raises(TypeError, match=r"LabelledDDP\(\) got an unexpected keyword argument 'bucket_cap_mb'"):
        LabelledDDP(bucket_cap_mb=5)


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_one_process(strategy: str) -> _Tiny:
    L.seed_everything(3)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    module = _Tiny()
    L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, enable_model_summary=False, **TRAINER_FLAGS
    ).fit(module, DataLoader(data, batch_size=16, shuffle=True))
    return module


@pytest.mark.usefixtures("undo_library_side_effects")
def test_acc_no_trains_exactly_like_lightning_single_device() -> None:
    ours, theirs = _fit_one_process("acc_no"), _fit_one_process("single_device")
    assert len(ours.losses) == 8
    assert ours.losses == theirs.losses
    for (name, a), b in zip(ours.net.state_dict().items(), theirs.net.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_process_group_options_reach_init_process_group() -> None:
    strategy = AcceleratedDDPStrategy(
        "MULTI_CPU",
        init_kwargs=InitProcessGroupKwargs(init_method="tcp://10.0.0.1:1234", timeout=timedelta(seconds=9)),
    )
    assert strategy._family.process_group_kwargs(torch.device("cpu")) == {
        "timeout": timedelta(seconds=9),
        "init_method": "tcp://10.0.0.1:1234",
    }
    default = AcceleratedDDPStrategy("MULTI_GPU")._family.process_group_kwargs(torch.device("cuda", 1))
    assert default == {"timeout": timedelta(minutes=30), "device_id": torch.device("cuda", 1)}


def test_acc_ddp_refuses_a_submitit_local_task_without_torchs_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """In each of 2 submitit local tasks, Lightning would start 2 processes of its own: refused, naming the export."""
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "2")
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "0")
    with pytest.raises(ValueError, match=r"TorchDistributedEnvironment\(\)\.export"):
        L.Trainer(strategy="acc_ddp", accelerator="cpu", devices=2, logger=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # exported: Lightning's environment reads torch's variables
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert L.Trainer(strategy="acc_ddp", accelerator="cpu", devices=2, logger=False).world_size == 2
