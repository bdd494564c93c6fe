"""More of ``accelerate.utils`` in ``lightning_accel.utils``, checked against HF accelerate 1.15 on the same inputs.

Model helpers (compiled regions, unwrapping, module order, safetensors cleaning), small helpers (names, dict merging,
sizes, attribute paths), the environment readers (with a stand-in ``nvidia-smi``), the nested-data operations,
``tqdm``, constants, dataclasses and FP8 recipe kwargs, and the trackers' signatures. The FSDP helpers are in
``test_fsdp_utils.py``; the DeepSpeed, torchao and Transformer Engine helpers in ``test_accelerate_utils_backends.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import io
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import accelerate.utils as hf
import accelerate.utils.dataclasses as hf_dataclasses
import accelerate.utils.environment as hf_environment
import accelerate.utils.operations as hf_operations
import accelerate.utils.other as hf_other
import numpy as np
import pytest
import torch
from torch import nn

import lightning_accel.utils.dataclasses as our_dataclasses
import lightning_accel.utils.environment as our_environment
import lightning_accel.utils.operations as our_operations
import lightning_accel.utils.other as our_other
from lightning_accel import utils as ours


@pytest.fixture
def hf_state() -> Iterator[None]:
    """HF accelerate's PartialState (its loggers and ``tqdm`` need one), forgotten afterwards."""
    from accelerate.state import PartialState

    PartialState(cpu=True)
    yield
    PartialState._reset_state()


def test_every_name_of_this_file_exists_at_accelerates_paths() -> None:
    names = {
        "accelerate.utils": [
            "GatheredParameters",
            "get_int_from_env",
            "parse_choice_from_env",
            "merge_dicts",
            "recursive_getattr",
            "get_pretty_name",
            "is_port_in_use",
            "has_compiled_regions",
            "model_has_dtensor",
            "get_module_children_bottom_up",
            "set_numa_affinity",
            "get_cpu_distributed_information",
            "get_current_device_type",
            "get_gpu_info",
            "tqdm",
            "TORCH_LAUNCH_PARAMS",
            "save_fsdp_model",
            "HfDeepSpeedConfig",
            "MSAMPRecipeKwargs",
            "TensorInformation",
            "TorchTensorParallelPlugin",
            "convert_model",
            "has_ao_layers",
        ],
        "accelerate.utils.other": ["TORCH_SAFE_GLOBALS", "is_repeated_blocks", "has_repeated_blocks"],
        "accelerate.utils.environment": ["CPUInformation", "override_numa_affinity", "get_driver_version"],
        "accelerate.utils.operations": ["TENSOR_TYPE_TO_INT", "verify_operation", "chained_operation", "get_shape"],
        "accelerate.utils.dataclasses": ["FP8Format", "OptLevel", "ProfilerActivity", "get_module_class_from_name"],
        "accelerate.utils.fsdp_utils": ["fsdp2_prepare_auto_wrap_policy", "get_parameters_from_modules"],
    }
    import importlib

    for module, wanted in names.items():
        mine = importlib.import_module(module.replace("accelerate", "lightning_accel", 1))
        theirs = importlib.import_module(module)
        for name in wanted:
            assert hasattr(theirs, name), (module, name)
            assert hasattr(mine, name), (module, name)
            if callable(getattr(theirs, name)) and not isinstance(getattr(theirs, name), type):
                a = list(inspect.signature(getattr(theirs, name)).parameters)
                assert list(inspect.signature(getattr(mine, name)).parameters) == a, (module, name)


# ---- model helpers ------------------------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _shape(module: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in module.named_modules()]


def test_compile_regions_as_hf() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack()
    before = _shape(model)
    mine, theirs = ours.compile_regions(model, backend="eager"), hf.compile_regions(model, backend="eager")
    assert _shape(mine) == _shape(theirs)
    assert _shape(model) == before  # the original is left as it was
    assert mine.__dict__["_orig_mod"] is model and theirs.__dict__["_orig_mod"] is model
    x = torch.randn(3, 4)
    torch.testing.assert_close(mine(x), model(x), rtol=0, atol=0)
    for module in (mine, theirs):
        assert ours.has_compiled_regions(module) and hf.has_compiled_regions(module)
        assert ours.extract_model_from_parallel(module, keep_torch_compile=False) is model
        assert hf.extract_model_from_parallel(module, keep_torch_compile=False) is model
        assert ours.extract_model_from_parallel(module) is module
    plain = nn.Linear(2, 2)
    assert ours.is_compiled_module(ours.compile_regions(plain, backend="eager"))  # no repeated blocks: compiled whole


@pytest.mark.parametrize("name", ["compile_regions_deepspeed", "compile_regions_fsdp2"])
def test_in_place_regional_compilation_as_hf(name: str) -> None:
    torch._dynamo.reset()
    compiled = {}
    for library in (ours, hf):
        model = Stack()
        result = getattr(library, name)(model, backend="eager")
        compiled[library.__name__] = [n for n, m in model.named_modules() if m._compiled_call_impl is not None]
        assert result is (model if name.endswith("fsdp2") else None)
    assert (
        compiled["lightning_accel.utils"]
        == compiled["accelerate.utils"]
        == [
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "head",
        ]
    )


def test_repeated_blocks_and_compiled_regions_checks() -> None:
    cases = [nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)]), nn.ModuleList([nn.Linear(1, 1), nn.ReLU()])]
    cases += [nn.ModuleList(), Stack(), nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))]
    for module in cases:
        assert our_other.is_repeated_blocks(module) == hf_other.is_repeated_blocks(module)
        assert our_other.has_repeated_blocks(module) == hf_other.has_repeated_blocks(module)
        assert ours.has_compiled_regions(module) == hf.has_compiled_regions(module) is False


def test_model_has_dtensor_without_dtensors() -> None:
    assert ours.model_has_dtensor(Stack()) is hf.model_has_dtensor(Stack()) is False


class _Wrapper(nn.Module):
    """A wrapper that keeps the wrapped module as ``.module`` (as DDP, FSDP1 and XLA's FSDP do)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_extract_model_from_parallel_recursive_as_hf() -> None:
    def build() -> nn.Module:
        inner = nn.Sequential(_Wrapper(nn.Linear(2, 2)), nn.ReLU(), _Wrapper(_Wrapper(nn.Linear(2, 1))))
        return nn.DataParallel(inner)

    for recursive in (False, True):
        mine = ours.extract_model_from_parallel(build(), recursive=recursive)
        theirs = hf.extract_model_from_parallel(build(), recursive=recursive)
        assert _shape(mine) == _shape(theirs)
    assert [type(m).__name__ for m in ours.extract_model_from_parallel(build(), recursive=True)] == [
        "Linear",
        "ReLU",
        "Linear",
    ]
    signature = inspect.signature(ours.extract_model_from_parallel)
    assert list(signature.parameters) == list(inspect.signature(hf.extract_model_from_parallel).parameters)


def test_module_children_bottom_up_as_hf() -> None:
    model = nn.Sequential(Stack(), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    for fqns in (False, True):
        mine = ours.get_module_children_bottom_up(model, return_fqns=fqns)
        theirs = hf.get_module_children_bottom_up(model, return_fqns=fqns)
        if fqns:
            assert [(n, id(m)) for n, m in mine] == [(n, id(m)) for n, m in theirs]
            assert mine[-1] == ("", model)
        else:
            assert [id(m) for m in mine] == [id(m) for m in theirs]
            assert mine[-1] is model


def test_clean_state_dict_for_safetensors_as_hf(hf_state: None) -> None:
    def tied() -> collections.OrderedDict[str, Any]:
        weight = torch.randn(3, 2)
        return collections.OrderedDict(a=weight, b=weight, c=weight.t(), meta="bnb-string", d=torch.ones(2))

    state_mine, state_theirs = tied(), tied()
    mine = ours.clean_state_dict_for_safetensors(state_mine)
    theirs = hf.clean_state_dict_for_safetensors(state_theirs)
    assert list(mine) == list(theirs) == ["a", "meta", "d"]  # the transpose is a view of the same storage too
    assert list(state_mine) == list(state_theirs)  # both delete the aliases from the dict they get
    assert all(v.is_contiguous() for v in mine.values() if isinstance(v, torch.Tensor))


def test_small_helpers_as_hf() -> None:
    class Thing:
        def method(self) -> None: ...

    for obj in (Thing, Thing(), Thing.method, len, 3, "text", nn.Linear(1, 1), ours.get_pretty_name):
        assert ours.get_pretty_name(obj) == hf.get_pretty_name(obj)
    for size in (0, 1, 1023, 1024, 1536, 10**6, 5 * 2**30, 2**40, 3 * 2**50, 2**60):
        assert ours.convert_bytes(size) == hf.convert_bytes(size), size
    source = {"a": 1, "b": {"c": 2, "d": {"e": 3}}, "f": [1]}
    for destination in ({}, {"b": {"x": 0, "d": {"e": 0, "y": 1}}, "f": 0}):
        mine = ours.merge_dicts(source, json.loads(json.dumps(destination)))
        assert mine == hf.merge_dicts(source, json.loads(json.dumps(destination)))
    holder = SimpleNamespace(a=SimpleNamespace(b=SimpleNamespace(c=5)))
    assert ours.recursive_getattr(holder, "a.b.c") == hf.recursive_getattr(holder, "a.b.c") == 5
    assert ours.recursive_getattr(holder, "a") is holder.a
    for library in (ours, hf):
        with pytest.raises(AttributeError):
            library.recursive_getattr(holder, "a.x")
    assert ours.is_port_in_use(1) == hf.is_port_in_use(1)
    assert ours.is_port_in_use is our_other.is_port_in_use


def test_load_allows_numpy_rng_states_as_hf(tmp_path: Path) -> None:
    assert our_other.TORCH_SAFE_GLOBALS == hf_other.TORCH_SAFE_GLOBALS
    allowed = torch.serialization.get_safe_globals()
    state = {"numpy": np.random.get_state(), "bytes": b"\x00\x01", "array": np.arange(3, dtype=np.uint32)}
    torch.save(state, tmp_path / "rng.pkl")
    mine, theirs = ours.load(tmp_path / "rng.pkl"), hf.load(tmp_path / "rng.pkl")
    assert mine["bytes"] == theirs["bytes"] and np.array_equal(mine["array"], theirs["array"])
    assert all(np.array_equal(a, b) for a, b in zip(mine["numpy"][1:2], theirs["numpy"][1:2], strict=True))
    after = torch.serialization.get_safe_globals()  # nothing more allowed afterwards (HF's load may reorder them)
    assert {id(item) for item in after} == {id(item) for item in allowed}


# ---- environment --------------------------------------------------------------------------------------------------


def test_env_readers_as_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LA_A", "-1")
    monkeypatch.setenv("LA_B", "3")
    monkeypatch.setenv("LA_CHOICE", "bf16")
    for keys, default in ((["LA_MISSING"], 7), (["LA_A", "LA_B"], 0), (["LA_B", "LA_A"], 1), ([], 4)):
        assert ours.get_int_from_env(keys, default) == hf.get_int_from_env(keys, default)
    for key, default in (("LA_CHOICE", "no"), ("LA_MISSING", "no"), ("LA_MISSING", 5)):
        assert ours.parse_choice_from_env(key, default) == hf.parse_choice_from_env(key, default)
    assert ours.parse_choice_from_env("LA_MISSING") == hf.parse_choice_from_env("LA_MISSING") == "no"
    monkeypatch.setenv("LA_BAD", "x")
    for library in (ours, hf):
        with pytest.raises(ValueError):
            library.get_int_from_env(["LA_BAD"], 0)
    names = ("torch", "lightning_accel", "surely_not_imported_here")
    assert (
        ours.are_libraries_initialized(*names) == hf.are_libraries_initialized(*names) == ["torch", "lightning_accel"]
    )
    assert ours.get_current_device_type() == hf.get_current_device_type()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
        {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
        {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
    ],
)
def test_cpu_distributed_information_as_hf(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key in list(os.environ):
        if key.endswith(("RANK", "SIZE", "RANKID", "NRANKS")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    mine, theirs = ours.get_cpu_distributed_information(), hf.get_cpu_distributed_information()
    assert dataclasses.asdict(mine) == dataclasses.asdict(theirs)
    assert [f.name for f in dataclasses.fields(mine)] == [f.name for f in dataclasses.fields(theirs)]


def _fake_nvidia_smi(folder: Path, rows: list[str], driver: str) -> None:
    """An ``nvidia-smi`` on ``PATH`` answering the queries Accelerate's readers make."""
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=count,name) printf '%s\\n' {' '.join(repr(r) for r in rows)} ;;\n"
        f"  --query-gpu=driver_version) printf '%s\\n' '{driver}' '{driver}' ;;\n"
        "  *) exit 1 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)


@pytest.mark.parametrize(
    ("rows", "driver", "supported"),
    [
        (["2, NVIDIA GeForce RTX 4090", "2, NVIDIA GeForce RTX 4090"], "535.1", False),
        (["2, NVIDIA GeForce RTX 4090", "2, NVIDIA GeForce RTX 4090"], "550.54.14", True),
        (["1, NVIDIA GeForce RTX 4090"], "535.1", True),
        (["2, NVIDIA H100 80GB HBM3", "2, NVIDIA H100 80GB HBM3"], "535.1", True),
    ],
)
def test_gpu_info_from_nvidia_smi_as_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: list[str], driver: str, supported: bool
) -> None:
    _fake_nvidia_smi(tmp_path, rows, driver)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert ours.get_gpu_info() == hf.get_gpu_info() == ([r.split(",")[1].strip() for r in rows], len(rows))
    assert our_environment.get_driver_version() == hf_environment.get_driver_version() == driver
    assert ours.check_cuda_p2p_ib_support() == hf.check_cuda_p2p_ib_support() == supported


def test_gpu_info_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    for library in (ours, hf):
        with pytest.raises(FileNotFoundError):
            library.get_gpu_info()
        assert library.check_cuda_p2p_ib_support() is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="binds CPUs to the GPU's NUMA node")
def test_numa_affinity_without_a_gpu_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    for library in (ours, hf):
        library.set_numa_affinity(0)
        library.set_numa_affinity(0, verbose=True)
        assert os.sched_getaffinity(0) == before
    our_environment.override_numa_affinity(0)
    assert our_environment.set_numa_affinity.cache_info().hits >= 0  # cached as Accelerate's


# ---- operations ---------------------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


def test_structure_helpers_as_hf() -> None:
    for obj, items in (([1], [2, 3]), ((1,), (2, 3)), (Point(1, 2), [3, 4])):
        assert ours.honor_type(obj, iter(items)) == hf.honor_type(obj, iter(items))
        assert type(ours.honor_type(obj, iter(items))) is type(obj)
    data = {"a": torch.ones(2, 3), "b": [torch.zeros(1, dtype=torch.int64), Point(torch.ones(4), 5)], "c": "text"}
    mine, theirs = ours.get_data_structure(data), hf.get_data_structure(data)
    assert str(mine) == str(theirs).replace("accelerate.utils.dataclasses.", "")
    assert our_operations.get_shape(data) == hf_operations.get_shape(data)
    assert ours.is_tensor_information(mine["a"]) and not ours.is_tensor_information(data["a"])
    assert hf.is_tensor_information(theirs["a"])
    rebuilt, hf_rebuilt = ours.initialize_tensors(mine), hf.initialize_tensors(theirs)
    assert our_operations.get_shape(rebuilt) == hf_operations.get_shape(hf_rebuilt) == our_operations.get_shape(data)
    assert rebuilt["b"][0].dtype == hf_rebuilt["b"][0].dtype == torch.int64
    assert type(rebuilt["b"][1]) is Point
    for value in (data, [], {}, "x", [torch.ones(3)], {"k": torch.ones(5, 1)}, [[1]]):
        assert ours.ignorant_find_batch_size(value) == hf.ignorant_find_batch_size(value)


def test_tensor_type_codes_and_xpu_check() -> None:
    assert our_operations.TENSOR_TYPE_TO_INT == hf_operations.TENSOR_TYPE_TO_INT
    assert our_operations.TENSOR_INT_TO_DTYPE == hf_operations.TENSOR_INT_TO_DTYPE
    assert our_operations.is_torch_xpu_tensor(torch.ones(1)) is False  # Accelerate's raises a TypeError here


def test_parameter_names_are_accelerates() -> None:
    assert ours.gather_object(object=[1, 2]) == hf.gather_object(object=[1, 2]) == [1, 2]
    assert ours.is_torch_tensor(tensor=torch.ones(1)) and hf.is_torch_tensor(tensor=torch.ones(1))
    assert ours.is_namedtuple(data=Point(1, 2)) and hf.is_namedtuple(data=Point(1, 2))


def test_gathered_parameters_is_a_no_op_without_deepspeed() -> None:
    from accelerate import Accelerator

    from tests.helpers import reset_accelerator_states

    Accelerator(cpu=True)  # HF's reads the run's state (and refuses without one)
    layer = nn.Linear(2, 2)
    for library in (ours, hf):
        with library.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            layer.weight.data.fill_(1.0)
        assert torch.equal(layer.weight, torch.ones(2, 2))
        layer.weight.data.zero_()
    reset_accelerator_states()


def test_operation_decorators_pass_through_in_one_process() -> None:
    def twice(tensor: torch.Tensor) -> torch.Tensor:
        return tensor * 2

    for decorator in (our_operations.verify_operation, our_operations.chained_operation):
        wrapped = decorator(twice)
        assert wrapped.__name__ == "twice"
        assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0))

    @our_operations.chained_operation
    def fails(tensor: torch.Tensor) -> None:
        raise ours.DistributedOperationException("shapes differ")

    with pytest.raises(ours.DistributedOperationException, match="Error found while calling") as info:
        fails(torch.ones(1))
    assert "shapes differ" in str(info.value.__cause__)


def test_fp32_wrapper_refuses_pickling_as_hf() -> None:
    for library in (our_operations, hf_operations):
        wrapper = library.ConvertOutputsToFp32(lambda x: x.half())
        assert wrapper(torch.ones(1)).dtype == torch.float32
        with pytest.raises(pickle.PicklingError, match="Cannot pickle a prepared model"):
            pickle.dumps(wrapper)
    model = nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = ours.convert_outputs_to_fp32(model.forward)
    assert ours.extract_model_from_parallel(model, keep_fp32_wrapper=False).forward == nn.Linear.forward.__get__(model)


# ---- tqdm, constants, dataclasses ---------------------------------------------------------------------------------


def test_tqdm_as_hf(hf_state: None) -> None:
    for kwargs in ({}, {"main_process_only": False}, {"disable": True}, {"total": 3, "file": io.StringIO()}):
        mine, theirs = ours.tqdm(range(3), **kwargs), hf.tqdm(range(3), **kwargs)
        assert type(mine) is type(theirs)
        assert mine.disable == theirs.disable
        assert list(mine) == list(theirs) == [0, 1, 2]
    for library in (ours, hf):
        with pytest.raises(ValueError, match="main_process_only"):
            library.tqdm(True, range(3))


def test_constants_are_accelerates() -> None:
    import accelerate.utils.constants as theirs

    import lightning_accel.utils.constants as mine

    names = [n for n in dir(theirs) if n.isupper()]
    assert not [n for n in names if not hasattr(mine, n)]
    for name in names:
        a, b = getattr(theirs, name), getattr(mine, name)
        assert (list(a) == list(b)) if isinstance(a, (list, tuple)) else a == b, name


def test_dataclasses_as_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_FP8_OPT_LEVEL", raising=False)
    for name in ("Backend", "OptLevel", "FP8Format", "AmaxComputeAlgorithm", "ProfilerActivity"):
        assert get_args(getattr(our_dataclasses, name)) == get_args(getattr(hf_dataclasses, name))
    for name in ("TensorInformation", "TorchTensorParallelPlugin", "MSAMPRecipeKwargs", "FP8RecipeKwargs"):
        mine = [(f.name, f.default) for f in dataclasses.fields(getattr(ours, name))]
        assert mine == [(f.name, f.default) for f in dataclasses.fields(getattr(hf, name))], name
    assert ours.MSAMPRecipeKwargs().opt_level == hf.MSAMPRecipeKwargs().opt_level == "O2"
    assert ours.MSAMPRecipeKwargs("O1").opt_level == hf.MSAMPRecipeKwargs("O1").opt_level == "O1"
    for library in (ours, hf):
        with pytest.raises(ValueError, match="opt_level"):
            library.MSAMPRecipeKwargs("O3")
    plugin = ours.TorchTensorParallelPlugin(tp_size=2)
    assert dataclasses.asdict(plugin) == dataclasses.asdict(hf.TorchTensorParallelPlugin(tp_size=2))
    info = ours.TensorInformation(shape=torch.Size([2]), dtype=torch.float16)
    assert dataclasses.asdict(info) == dataclasses.asdict(hf.TensorInformation(torch.Size([2]), torch.float16))
    model = nn.Sequential(Stack(), nn.ReLU())
    for class_name in ("Stack", "Linear", "ReLU", "Missing", "Sequential"):
        assert our_dataclasses.get_module_class_from_name(
            model, class_name
        ) is hf_dataclasses.get_module_class_from_name(model, class_name)


def test_fp8_recipe_kwargs_take_accelerates_positional_order() -> None:
    with pytest.warns(FutureWarning, match="deprecated"):
        recipe = ours.FP8RecipeKwargs(None, True, 2, 3, "e4m3")
    assert (recipe.opt_level, recipe.use_autocast_during_eval, recipe.margin, recipe.interval) == (None, True, 2, 3)
    assert recipe.fp8_format == "E4M3" and recipe.backend == "TE"
    te = ours.TERecipeKwargs(None, None, None, "e5m2")
    assert (te.use_autocast_during_eval, te.margin, te.interval, te.fp8_format) == (False, 0, 1, "E5M2")
    assert te.to_kwargs() == {"fp8_format": "E5M2"}  # only what differs from the defaults
    for name in ("FP8RecipeKwargs", "TERecipeKwargs"):
        mine = inspect.signature(getattr(ours, name)).parameters
        theirs = inspect.signature(getattr(hf, name)).parameters
        assert [(p.name, p.default) for p in mine.values()] == [(p.name, p.default) for p in theirs.values()]


# ---- trackers -----------------------------------------------------------------------------------------------------


def test_tracker_signatures_are_accelerates() -> None:
    import accelerate.tracking as hf_tracking

    import lightning_accel.tracking as our_tracking

    for name in ("AimTracker", "ClearMLTracker", "DVCLiveTracker", "SwanLabTracker", "TrackioTracker"):
        mine = inspect.signature(getattr(our_tracking, name)).parameters
        theirs = inspect.signature(getattr(hf_tracking, name)).parameters
        assert [(p.name, p.default, p.kind) for p in mine.values()] == [
            (p.name, p.default, p.kind) for p in theirs.values()
        ], name
    for name in ("ClearMLTracker", "DVCLiveTracker"):  # run_name is optional, as in Accelerate
        assert getattr(our_tracking, name)().tracker is None  # nothing started (nor imported) before start()
    assert list(inspect.signature(our_tracking.on_main_process).parameters) == ["function"]
