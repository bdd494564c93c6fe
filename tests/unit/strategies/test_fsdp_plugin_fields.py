"""Every field of ``FullyShardedDataParallelPlugin`` is honoured by ``acc_fsdp`` or refused, per FSDP version.

The test walks ``dataclasses.fields`` of the plugin: each field must have a check below for FSDP2 and FSDP1 that
wraps a small model with :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily` (what ``acc_fsdp`` and
``acc_parallel`` run) in a one-process gloo group and asserts what the field does, or that it is refused (an exception
naming it) or reported as having no effect for that version (a warning naming it). A field added to the plugin later
fails :func:`test_every_field_has_a_check` until someone decides what it does. Multi-process behaviour
(``cpu_ram_efficient_loading`` broadcasting process 0's weights, offloading wrappers against HF's) is checked in
``tests/test_fsdp2_apply.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_accel.config import FullyShardedDataParallelPlugin
from lightning_accel.strategies.fsdp_core import FSDPFamily
from tests.scripts.fsdp_utils_parity import Net

BLOCKS = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Generator[None, None, None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port to race for
    yield
    dist.destroy_process_group()


def wrap(version: int, **fields: Any) -> nn.Module:
    torch.manual_seed(0)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, **fields)
    return FSDPFamily(plugin).wrap(Net(), CPU, 1)


def units(model: nn.Module) -> set[str]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return {
        name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        for name, m in model.named_modules()
        if isinstance(m, (FSDPModule, FullyShardedDataParallel))
    }


def classes(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def refused(field: str, version: int, error: type[Exception], **fields: Any) -> None:
    with pytest.raises(error, match=field):
        wrap(version, **fields)


def no_effect(field: str, version: int, **fields: Any) -> None:
    with pytest.warns(UserWarning, match=f"{field}=.*(no effect|ignored)"):
        FullyShardedDataParallelPlugin(fsdp_version=version, **fields)


def fsdp2_resharding(reshard: bool) -> bool:
    model = wrap(2, **BLOCKS, reshard_after_forward=reshard)
    group = model.blocks[0]._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    return group.post_forward_mesh_info is not None


def compute_dtype(model: nn.Module) -> torch.dtype:
    seen: list[torch.dtype] = []
    block = model.blocks[0]
    fc = getattr(block, "fc", None) or block.module.fc  # type: ignore[union-attr]
    fc.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    model(torch.tensor([[1, 2]]))
    return seen[0]


def state_dict_is_sharded(version: int, state_dict_type: str) -> bool:
    from torch.distributed.tensor import DTensor

    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)
    family = FSDPFamily(plugin)
    torch.manual_seed(0)
    model = family.wrap(Net(), CPU, 1)
    values = family.model_state_dict(model).values()
    return any(isinstance(v, DTensor) or type(v).__name__ == "ShardedTensor" for v in values)


def offload_follows(field: str, version: int) -> bool:
    """Whether the plugin's config decides if a gathered state dict is offloaded to the CPU.

    Seen on a module off the CPU (on the meta device; torch's state-dict reader is stubbed): on the CPU nothing is
    moved whatever the config says.
    """
    from unittest import mock

    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    model_field = field == "state_dict_config"
    reader = "get_model_state_dict" if model_field else "get_optimizer_state_dict"
    offloads = []
    for config in ((FullStateDictConfig if model_field else FullOptimStateDictConfig)(offload_to_cpu=False), None):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, state_dict_type="FULL_STATE_DICT", **{field: config}
        )
        family, off_cpu = FSDPFamily(plugin), nn.Linear(2, 2, device="meta")
        with mock.patch(f"torch.distributed.checkpoint.state_dict.{reader}", return_value={}) as read:
            if model_field:
                family.model_state_dict(off_cpu)
            else:
                family.optimizer_state_dict(off_cpu, torch.optim.SGD(off_cpu.parameters(), lr=0.1))
        offloads.append(read.call_args.kwargs["options"].cpu_offload)
    return offloads == [False, True]


def state_dict_config_decided(field: str, version: int) -> None:
    """Honoured (its ``offload_to_cpu``); refused, naming it, when its kind does not fit ``state_dict_type``."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    wrong = FullStateDictConfig() if field == "state_dict_config" else FullOptimStateDictConfig()
    refused(field, version, ValueError, state_dict_type="SHARDED_STATE_DICT", **{field: wrong})
    assert offload_follows(field, version)


def weights_kept(version: int, **fields: Any) -> bool:
    torch.manual_seed(0)
    expected = Net().state_dict()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, **fields)
    family = FSDPFamily(plugin)
    torch.manual_seed(0)
    full = family.model_state_dict(family.wrap(Net(), CPU, 1), full=True)
    return all(torch.equal(full[k], expected[k]) for k in expected)


def fsdp1_given_strategy(name: str, **fields: Any) -> None:
    with pytest.warns(UserWarning, match=f"instead of ShardingStrategy.{name} since the world size is 1"):
        wrap(1, **fields)


def fsdp1_attribute(attribute: str, **fields: Any) -> Any:
    return getattr(wrap(1, **fields), attribute)


Check = Callable[[], None]

FSDP2: dict[str, Check] = {
    "fsdp_version": lambda: None if "FSDPNet" in classes(wrap(2)) else pytest.fail("not an FSDP2 module"),
    "sharding_strategy": lambda: no_effect("sharding_strategy", 2, sharding_strategy="SHARD_GRAD_OP"),
    "reshard_after_forward": lambda: _assert(fsdp2_resharding(True) and not fsdp2_resharding(False)),
    "backward_prefetch": lambda: no_effect("backward_prefetch", 2, backward_prefetch="BACKWARD_POST"),
    "mixed_precision_policy": lambda: _assert(
        compute_dtype(
            wrap(
                2,
                **BLOCKS,
                mixed_precision_policy={
                    "param_dtype": torch.bfloat16,
                    "reduce_dtype": torch.float32,
                    "output_dtype": torch.float32,
                },
            )
        )
        == torch.bfloat16
        and compute_dtype(wrap(2, **BLOCKS)) == torch.float32
    ),
    "auto_wrap_policy": lambda: _assert(units(wrap(2, **BLOCKS)) >= {"blocks.0", "blocks.2"}),
    "cpu_offload": lambda: refused("cpu_offload", 2, ValueError, cpu_offload=True),
    "ignored_modules": lambda: _assert(
        type(wrap(2, ignored_modules="final_norm").final_norm.weight) is nn.Parameter
        and type(wrap(2).final_norm.weight) is not nn.Parameter
    ),
    "state_dict_type": lambda: _assert(
        state_dict_is_sharded(2, "SHARDED_STATE_DICT") and not state_dict_is_sharded(2, "FULL_STATE_DICT")
    ),
    "state_dict_config": lambda: state_dict_config_decided("state_dict_config", 2),
    "optim_state_dict_config": lambda: state_dict_config_decided("optim_state_dict_config", 2),
    "limit_all_gathers": lambda: no_effect("limit_all_gathers", 2, limit_all_gathers=False),
    "use_orig_params": lambda: no_effect("use_orig_params", 2, use_orig_params=True),
    "param_init_fn": lambda: no_effect("param_init_fn", 2, param_init_fn=lambda m: None),
    "sync_module_states": lambda: no_effect("sync_module_states", 2, sync_module_states=True),
    "forward_prefetch": lambda: _refused_by_plugin("forward_prefetch", fsdp_version=2, forward_prefetch=True),
    "activation_checkpointing": lambda: _assert(
        "FSDPCheckpointWrapper" in classes(wrap(2, **BLOCKS, activation_checkpointing=True))
        and "FSDPCheckpointWrapper" not in classes(wrap(2, **BLOCKS))
    ),
    "activation_checkpointing_offload": lambda: _assert(
        "OffloadWrapper"
        in classes(wrap(2, **BLOCKS, activation_checkpointing=True, activation_checkpointing_offload=True))
    ),
    "cpu_ram_efficient_loading": lambda: _assert(weights_kept(2, **BLOCKS, cpu_ram_efficient_loading=True)),
    "transformer_cls_names_to_wrap": lambda: _assert(
        {"blocks.0", "blocks.1", "blocks.2"} <= units(wrap(2, **BLOCKS))
        and "blocks.0"
        not in units(wrap(2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LayerNorm"]))
    ),
    "min_num_params": lambda: _assert(
        "blocks.0.fc" in units(wrap(2, auto_wrap_policy="size_based_wrap", min_num_params=60))
        and "blocks.0.fc" not in units(wrap(2, auto_wrap_policy="size_based_wrap", min_num_params=100))
    ),
}

# FSDP1, where a field does something else than under FSDP2 (the other fields share the FSDP2 check's meaning).
FSDP1: dict[str, Check] = {
    "fsdp_version": lambda: _assert(type(wrap(1)).__name__ == "FullyShardedDataParallel"),
    # One process: torch's FSDP1 replaces the strategy it is given by NO_SHARD, and says which one it was given.
    "sharding_strategy": lambda: fsdp1_given_strategy("SHARD_GRAD_OP", sharding_strategy="SHARD_GRAD_OP"),
    "reshard_after_forward": lambda: fsdp1_given_strategy("SHARD_GRAD_OP", reshard_after_forward="SHARD_GRAD_OP"),
    "backward_prefetch": lambda: _assert(
        fsdp1_attribute("backward_prefetch", backward_prefetch="BACKWARD_POST").name == "BACKWARD_POST"
    ),
    "mixed_precision_policy": lambda: _assert(
        fsdp1_attribute("mixed_precision", mixed_precision_policy="bf16").param_dtype == torch.bfloat16
    ),
    "limit_all_gathers": lambda: _assert(fsdp1_attribute("limit_all_gathers", limit_all_gathers=False) is False),
    "use_orig_params": lambda: _assert(fsdp1_attribute("_use_orig_params", use_orig_params=True) is True),
    "forward_prefetch": lambda: _assert(fsdp1_attribute("forward_prefetch", forward_prefetch=True) is True),
    "sync_module_states": lambda: _assert(weights_kept(1, sync_module_states=True)),
    "state_dict_config": lambda: state_dict_config_decided("state_dict_config", 1),
    "optim_state_dict_config": lambda: state_dict_config_decided("optim_state_dict_config", 1),
    "activation_checkpointing_offload": lambda: _refused_by_plugin(
        "activation_checkpointing_offload",
        fsdp_version=1,
        activation_checkpointing=True,
        activation_checkpointing_offload=True,
    ),
}


def _assert(condition: bool) -> None:
    assert condition


def _refused_by_plugin(field: str, **fields: Any) -> None:
    with pytest.raises(ValueError, match=field):
        FullyShardedDataParallelPlugin(**fields)


def test_every_field_has_a_check() -> None:
    names = {field.name for field in dataclasses.fields(FullyShardedDataParallelPlugin)}
    assert names == set(FSDP2), "decide what the new FullyShardedDataParallelPlugin field does"
    assert set(FSDP1) <= names


@pytest.mark.parametrize("field", sorted(FSDP2))
def test_fsdp2_field(field: str) -> None:
    FSDP2[field]()


@pytest.mark.parametrize("field", sorted(FSDP1))
def test_fsdp1_field(field: str) -> None:
    FSDP1[field]()
