import enum
import json

import accelerate.utils.dataclasses as hf
import pytest

from lightning_accel import enums

ENUM_NAMES = [
    "DistributedType",
    "SageMakerDistributedType",
    "FP8BackendType",
    "ComputeEnvironment",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "DDPCommunicationHookType",
    "CustomDtype",
]


@pytest.mark.parametrize("name", ENUM_NAMES)
def test_members_and_values_match_accelerate(name):
    ours, theirs = getattr(enums, name), getattr(hf, name)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


@pytest.mark.parametrize("name", ENUM_NAMES)
def test_bases_match_accelerate(name):
    ours, theirs = getattr(enums, name), getattr(hf, name)
    assert issubclass(ours, str) == issubclass(theirs, str)
    assert issubclass(ours, enums.BaseEnum) == issubclass(theirs, hf.BaseEnum)
    assert isinstance(ours, enums.EnumWithContains) == isinstance(theirs, hf.EnumWithContains)


@pytest.mark.parametrize("name", ENUM_NAMES)
def test_str_and_format_match_accelerate(name):
    ours, theirs = getattr(enums, name), getattr(hf, name)
    for our_member, their_member in zip(ours, theirs, strict=True):
        assert str(our_member).split(".")[-1] == str(their_member).split(".")[-1]
        assert f"{our_member}".split(".")[-1] == f"{their_member}".split(".")[-1]


def test_precision_type():
    assert str(enums.PrecisionType.BF16) == "bf16"
    assert enums.PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert "bf16" in enums.PrecisionType
    assert "xx" not in enums.PrecisionType
    assert enums.PrecisionType.FP16 == "fp16"
    assert enums.PrecisionType("fp8") is enums.PrecisionType.FP8
    assert json.dumps({"p": enums.PrecisionType.BF16}) == '{"p": "bf16"}'


def test_distributed_type():
    assert len(enums.DistributedType) == 14
    assert enums.DistributedType.FSDP == "FSDP"
    assert all(member.value == member.name for member in enums.DistributedType)
    assert str(enums.DistributedType.NO) == "DistributedType.NO"
    assert json.dumps(enums.DistributedType.MULTI_CPU) == '"MULTI_CPU"'


def test_rng_type_is_not_a_string():
    assert enums.RNGType.TORCH != "torch"
    assert not isinstance(enums.RNGType.TORCH, str)
    assert "torch" in enums.RNGType
    assert enums.RNGType.TORCH in enums.RNGType
    assert str(enums.RNGType.GENERATOR) == "generator"
    assert enums.RNGType("cuda") is enums.RNGType.CUDA


def test_contains_rejects_unhashable_and_foreign_values():
    assert [] not in enums.LoggerType
    assert None not in enums.DDPCommunicationHookType
    assert "TENSORBOARD" not in enums.LoggerType  # values are case-sensitive


def test_list_of_other_base_enums():
    assert enums.LoggerType.list()[:3] == ["all", "aim", "tensorboard"]
    assert enums.DDPCommunicationHookType.list() == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
    assert enums.DynamoBackend.list()[0] == "NO"
    assert "INDUCTOR" in enums.DynamoBackend


def test_base_enum_is_an_enum():
    assert issubclass(enums.BaseEnum, enum.Enum)
    assert type(enums.BaseEnum) is enums.EnumWithContains


def test_module_exports():
    assert sorted(enums.__all__) == sorted([*ENUM_NAMES, "BaseEnum", "EnumWithContains"])
