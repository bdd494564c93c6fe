"""lightning_accel.utils helpers in one process: operations, seeding, memory, saving, logging."""

from __future__ import annotations

import logging
import random
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from lightning_accel import Accelerator, find_executable_batch_size
from lightning_accel.logging import get_logger
from lightning_accel.state import PartialState, reset_state
from lightning_accel.utils import (
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_to_fp32,
    extract_model_from_parallel,
    find_batch_size,
    gather,
    gather_object,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    release_memory,
    send_to_device,
    set_seed,
    slice_tensors,
    synchronize_rng_state,
)

Pair = namedtuple("Pair", ["a", "b"])


def test_recursively_apply_keeps_structure() -> None:
    data = {"x": [torch.ones(1), (torch.zeros(2), "text")], "p": Pair(torch.ones(1), 3)}
    doubled = recursively_apply(lambda t: t * 2, data)
    assert doubled["x"][0].tolist() == [2.0]
    assert isinstance(doubled["x"][1], tuple) and doubled["x"][1][1] == "text"
    assert isinstance(doubled["p"], Pair) and doubled["p"].b == 3
    with pytest.raises(TypeError, match="str"):
        recursively_apply(lambda t: t, ["text"], error_on_other_type=True)


def test_conversions() -> None:
    half = {"h": torch.ones(2, dtype=torch.float16), "b": torch.ones(1, dtype=torch.bfloat16), "i": torch.ones(1)}
    converted = convert_to_fp32(half)
    assert {k: v.dtype for k, v in converted.items()} == {"h": torch.float32, "b": torch.float32, "i": torch.float32}
    assert listify({"a": torch.tensor([1.5]), "b": torch.tensor(2, dtype=torch.bfloat16)}) == {"a": [1.5], "b": 2.0}
    assert find_batch_size({"x": [torch.zeros(5, 2)]}) == 5
    with pytest.raises(TypeError, match="str"):
        find_batch_size(["a"])
    with pytest.raises(ValueError, match="empty"):
        find_batch_size([])


def test_concatenate_slice_and_send() -> None:
    parts = [{"x": torch.ones(2, 1)}, {"x": torch.zeros(1, 1)}]
    assert concatenate(parts)["x"].shape == (3, 1)
    assert slice_tensors({"x": torch.arange(5)}, slice(1, 3))["x"].tolist() == [1, 2]
    moved = send_to_device({"x": torch.ones(1), "keep": torch.ones(1), "s": "text"}, "cpu", skip_keys="keep")
    assert moved["s"] == "text" and moved["x"].device.type == "cpu"


def test_collectives_in_one_process_return_their_input() -> None:
    t = torch.arange(3.0)
    assert gather(t).tolist() == [0.0, 1.0, 2.0]
    assert gather(torch.tensor(4.0)).tolist() == [4.0]
    assert gather_object(["a"]) == ["a"]
    with pytest.raises(TypeError, match="list or tuple"):
        gather_object("a")
    assert broadcast(t) is t
    assert broadcast_object_list([1]) == [1]
    assert reduce(t, reduction="sum", scale=2.0).tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="prod"):
        reduce(t, reduction="prod")
    assert pad_across_processes(t) is t


def test_set_seed_seeds_every_library() -> None:
    set_seed(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    with pytest.raises(ValueError, match="xla"):
        synchronize_rng_state("xla")
    with pytest.raises(ValueError, match="generator="):
        synchronize_rng_state("generator")
    synchronize_rng_state("torch")  # one process: nothing to do


def test_find_executable_batch_size_shrinks_on_out_of_memory() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=100)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 80:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size * scale

    assert train(2) == 144
    assert tried == [100, 90, 81, 72]  # int(0.9 * size) each time, as Accelerate

    @find_executable_batch_size(starting_batch_size=4)
    def never(batch_size: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(RuntimeError, match="reached zero"):
        never()

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    with pytest.raises(TypeError, match="batch size"):
        broken(8)


def test_release_memory_and_unwrapping() -> None:
    a, b = release_memory(torch.ones(1), torch.ones(1))
    assert a is None and b is None
    accelerator = Accelerator(cpu=True)
    inner = nn.Linear(1, 1)
    prepared = accelerator.prepare(inner)
    assert extract_model_from_parallel(prepared) is inner
    assert accelerator.unwrap_model(prepared) is inner


def test_get_logger_logs_on_the_main_process_only(caplog: pytest.LogCaptureFixture) -> None:
    logger = get_logger("lightning_accel.test", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="lightning_accel.test"):
        state = PartialState()
        logger.info("from main")
        state._configure(state.distributed_type, state.device, num_processes=2, process_index=1, local_index=1)
        logger.info("hidden")
        logger.info("shown everywhere", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] from main", "[RANK 1] shown everywhere"]
    with pytest.raises(ValueError, match="LOUD"):
        get_logger("x", log_level="LOUD")


def test_environment_checks() -> None:
    from lightning_accel.utils import (
        is_bf16_available,
        is_mps_available,
        is_npu_available,
        is_torch_version,
        is_torch_xla_available,
        is_xpu_available,
    )

    assert is_torch_version(">=", "2.0") and not is_torch_version("<", "2.0")
    with pytest.raises(ValueError, match="~="):
        is_torch_version("~=", "2.0")
    assert is_bf16_available() is (torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True)
    assert {is_mps_available(), is_npu_available(), is_xpu_available(), is_torch_xla_available()} <= {True, False}


def test_convert_outputs_to_fp32() -> None:
    from lightning_accel.utils import convert_outputs_to_fp32

    forward = convert_outputs_to_fp32(lambda x: {"y": x.to(torch.bfloat16), "n": 3})
    assert forward(torch.ones(2))["y"].dtype == torch.float32


def test_dynamo_backend_compiles_and_megatron_is_refused() -> None:
    from lightning_accel.utils import MegatronLMPlugin, is_compiled_module

    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    inner = nn.Linear(2, 1)
    prepared = accelerator.prepare(inner)
    assert accelerator.unwrap_model(prepared) is inner
    assert inner._compiled_call_impl is not None  # the strategy compiles in place (nn.Module.compile)
    assert not is_compiled_module(inner)
    assert prepared(torch.ones(1, 2)).shape == (1, 1)
    reset_state()
    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=accelerator_dynamo_plugin())
    with pytest.raises(ValueError, match="MEGATRON_LM"):
        Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin())


def accelerator_dynamo_plugin() -> object:
    from lightning_accel.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend="eager")
