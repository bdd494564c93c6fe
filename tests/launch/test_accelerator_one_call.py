"""Accelerate's one-call ``prepare(model, optimizer, loader, scheduler)`` with an optimizer built before sharding.

One 2-process CPU launch (``tests/scripts/accelerator_one_call.py``) trains the same script under HF accelerate's
``Accelerator(cpu=True)`` (MULTI_CPU) and lightning_accel's FSDP2, FSDP1 (original and flat parameters) and DeepSpeed
ZeRO-1/2/3, plus plain ``Fabric(strategy="acc_fsdp").setup(model, optimizer)``, and records the one-call errors. The
helpers that record and re-point the parameters are also tested here without processes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.strategies.fsdp_optimizers import optimizer_parameter_names, repoint_optimizers
from tests.helpers import torchrun
from tests.scripts.accelerator_one_call import net

pytest.importorskip("accelerate")

FSDP = ["fsdp2", "fsdp1", "fsdp1_flat"]
SHIMS = FSDP + (["zero1", "zero2", "zero3"] if importlib.util.find_spec("deepspeed") else [])
KEYS = {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("one_call")
    torchrun("accelerator_one_call.py", "--out", str(out), timeout=240)
    return [torch.load(out / f"one_call_rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_weights_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(reference) == KEYS
    for key, value in ours.items():
        torch.testing.assert_close(value.float(), reference[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("variant", SHIMS)
def test_one_call_prepare_trains_to_hf_accelerate_multi_cpu_weights_and_losses(
    ranks: list[dict[str, Any]], variant: str
) -> None:
    main = ranks[0]
    assert main["hf"]["type"] == "MULTI_CPU"
    assert main[variant]["type"] == ("FSDP" if variant in FSDP else "DEEPSPEED")
    _assert_weights_equal(main[variant]["weights"], main["hf"]["weights"])
    for key, initial in net().state_dict().items():  # it trained
        assert not torch.allclose(main["hf"]["weights"][key], initial, atol=1e-2), key
    for rank in ranks:
        assert len(rank[variant]["losses"]) == 8  # 64 samples, batch 4, split over 2 processes
        torch.testing.assert_close(rank[variant]["losses"], rank["hf"]["losses"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", SHIMS)
def test_param_groups_keep_their_settings_and_the_scheduler_drives_them(
    ranks: list[dict[str, Any]], variant: str
) -> None:
    for rank in ranks:
        assert rank[variant]["groups"] == rank["hf"]["groups"]
        assert [g["weight_decay"] for g in rank[variant]["groups"]] == [0.1, 0.0]
        assert rank[variant]["groups"][1]["betas"] == (0.8, 0.95)
        assert rank[variant]["lrs"] == pytest.approx([0.02 * 0.7**5, 0.01 * 0.7**5])  # 16 scheduler steps, as HF's


def test_fsdp_optimizers_hold_the_sharded_parameters(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert {
            v: (rank[v]["held_are_model_params"], rank[v]["held_dtensors"], rank[v]["held_count"]) for v in FSDP
        } == {
            "fsdp2": (True, 6, 6),  # the DTensor parameters fully_shard put in place of the originals
            "fsdp1": (True, 0, 6),  # use_orig_params=True: the original parameters, now views into the shards
            "fsdp1_flat": (True, 0, 3),  # one flat parameter per wrapped Linear
        }


def test_plain_fabric_setup_with_an_optimizer_built_before_sharding_gives_ddp_numbers(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        torch.testing.assert_close(rank["fabric_fsdp2"]["losses"], rank["plain_ddp"]["losses"], rtol=0, atol=1e-5)
    _assert_weights_equal(ranks[0]["fabric_fsdp2"]["weights"], ranks[0]["plain_ddp"]["weights"])


def test_float8_weights_wrapped_before_sharding_are_found_by_their_storage(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        fsdp2, ddp = rank["fp8_fsdp2"], rank["fp8_ddp"]
        assert fsdp2["float8_weight"] == "WeightWithDynamicFloat8CastTensor"  # a new parameter, made by torchao
        assert (fsdp2["held_are_model_params"], fsdp2["held_dtensors"]) == (True, 6)
        torch.testing.assert_close(fsdp2["losses"], ddp["losses"], rtol=0, atol=1e-5)


def test_one_call_errors_name_the_problem_and_the_fix(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    assert "flattens ['0.bias', '0.weight'] into one parameter" in errors["split_flat_parameter"]
    assert "use_orig_params=True" in errors["split_flat_parameter"]
    assert "shape (3, 5) at param_groups[0]['params'][6] that is not a parameter" in errors["foreign_tensor"]
    assert "already holds state for 6 parameters" in errors["stepped_optimizer"]
    for variant in ("separate_prepare_fsdp2", "separate_prepare_fsdp1_flat"):  # silent in HF accelerate's FSDP1
        assert "is not a parameter of any model acc_fsdp sharded" in errors[variant]
        assert "accelerator.prepare(model, optimizer, ...)" in errors[variant]
    assert ranks[1]["errors"] == errors


# ---- the helpers, without processes ----------------------------------------------------------------------------


def _replace_parameters(module: nn.Module) -> None:
    """What FSDP2 does to a module: a new parameter object under every name (a tied one stays tied)."""
    replacements: dict[int, nn.Parameter] = {}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        owner, local = name.rsplit(".", 1)
        replacement = replacements.setdefault(id(param), nn.Parameter(param.detach().clone()))
        setattr(module.get_submodule(owner), local, replacement)


def test_repoint_replaces_each_group_list_in_place_and_keeps_its_settings() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    groups: list[dict[str, Any]] = [
        {"params": [model[1].bias, model[0].weight]},
        {"params": [model[0].bias], "lr": 0.5, "momentum": 0.9},
    ]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    lists = [group["params"] for group in optimizer.param_groups]  # what LBFGS keeps a reference to
    names = optimizer_parameter_names(model, [optimizer])
    assert names == [[[("1.bias",), ("0.weight",)], [("0.bias",)]]]
    _replace_parameters(model)
    repoint_optimizers(model, [optimizer], names)
    assert [group["params"] for group in optimizer.param_groups] == lists
    assert all(a is b for a, b in zip(lists, (g["params"] for g in optimizer.param_groups), strict=True))
    assert lists[0][0] is model[1].bias and lists[0][1] is model[0].weight and lists[1][0] is model[0].bias
    assert [(g["lr"], g["momentum"]) for g in optimizer.param_groups] == [(0.1, 0), (0.5, 0.9)]


def test_a_tied_parameter_is_held_once_under_all_its_names() -> None:
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = optimizer_parameter_names(model, [optimizer])
    assert names == [[[("0.weight", "1.weight")]]]
    _replace_parameters(model)
    repoint_optimizers(model, [optimizer], names)
    assert len(optimizer.param_groups[0]["params"]) == 1
    assert optimizer.param_groups[0]["params"][0] is model[0].weight is model[1].weight


def test_a_name_missing_after_sharding_is_refused_and_nothing_changes() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    first, second = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    before = [list(first.param_groups[0]["params"]), list(second.param_groups[0]["params"])]
    names = optimizer_parameter_names(model, [first, second])
    model[1] = nn.Identity()
    with pytest.raises(ValueError, match=r"'1.weight' of optimizer 1 has no counterpart in the sharded model"):
        repoint_optimizers(model, [first, second], names)
    assert [first.param_groups[0]["params"], second.param_groups[0]["params"]] == before
