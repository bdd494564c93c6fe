"""Unit behaviour of the big-model helpers: offload files, sizes and budgets, errors, and where we differ from HF."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import accelerate
import accelerate.hooks
import accelerate.utils.modeling as hf_modeling
import pytest
import torch
from accelerate.utils import offload as hf_offload
from torch import nn

import lightning_accel
from lightning_accel import big_modeling
from lightning_accel.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module
from lightning_accel.utils import modeling, offload
from lightning_accel.utils.modeling.tensors import resolve_device


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(3, 4),
        "a.half": torch.randn(5).half(),
        "b.bf16": torch.randn(2, 2).bfloat16(),
        "b.fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "c.steps": torch.tensor(7),
        "c.mask": torch.tensor([True, False]),
    }


@pytest.mark.parametrize(("writer", "reader"), [(offload, hf_offload), (hf_offload, offload), (offload, offload)])
def test_offload_folders_are_interchangeable_with_hf(tmp_path: Path, writer: Any, reader: Any) -> None:
    tensors = _tensors()
    writer.offload_state_dict(tmp_path, tensors)
    loaded = reader.OffloadedWeightsLoader(save_folder=tmp_path)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_offload_index_matches_hf(tmp_path: Path) -> None:
    ours, theirs = {}, {}
    for name, tensor in _tensors().items():
        offload.offload_weight(tensor, name, tmp_path, index=ours)
        hf_offload.offload_weight(tensor, name, tmp_path, index=theirs)
    assert ours == theirs


def test_weights_loader_aliases_and_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="state_dict"):
        offload.OffloadedWeightsLoader()
    offload.offload_state_dict(tmp_path, {"embed.weight": torch.ones(2)})
    loader = offload.OffloadedWeightsLoader(state_dict={"x": torch.zeros(1)}, save_folder=tmp_path)
    loader.alias("head.weight", "embed.weight")
    assert torch.equal(loader["head.weight"], torch.ones(2))
    assert sorted(loader) == ["embed.weight", "head.weight", "x"]
    with pytest.raises(KeyError, match="missing"):
        loader.alias("y", "missing")
    prefixed = offload.PrefixedDataset(loader, "embed.")
    assert list(prefixed) == ["embed.weight"] and torch.equal(prefixed["weight"], torch.ones(2))


@pytest.mark.parametrize("size", ["0MB", "100MB", "2GiB", "512KiB", "1.5GB", "100KB", "8Mb", 500, "3KiB"])
def test_convert_file_size_to_int_matches_hf(size: int | str) -> None:
    assert modeling.convert_file_size_to_int(size) == hf_modeling.convert_file_size_to_int(size)


@pytest.mark.parametrize("size", ["5MBB", "5k0MB", "-1GB", "12", -3])
def test_convert_file_size_to_int_refuses(size: int | str) -> None:
    with pytest.raises(ValueError, match="not in a valid format"):
        modeling.convert_file_size_to_int(size)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.emb = nn.Embedding(10, 6)
        self.register_buffer("ids", torch.arange(10))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"dtype": torch.float16}, {"dtype": "bfloat16", "special_dtypes": {"lin.weight": "float32"}}],
)
def test_module_sizes_match_hf(kwargs: dict[str, Any]) -> None:
    model = Mixed()
    assert modeling.compute_module_sizes(model, **kwargs) == hf_modeling.compute_module_sizes(model, **kwargs)
    assert modeling.compute_module_total_buffer_size(model, **kwargs) == hf_modeling.compute_module_total_buffer_size(
        model, **kwargs
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_memory": {0: 400, 1: 400, "cpu": 1000}},
        {"max_memory": {0: 500, 1: 500, 2: 500}, "low_zero": True},
        {"max_memory": {0: 0, 1: 600, "cpu": 100}},
        {"max_memory": {0: "1KB", "cpu": "1MB"}, "no_split_module_classes": ["Linear"]},
    ],
)
def test_balanced_memory_matches_hf(kwargs: dict[str, Any]) -> None:
    model = nn.Sequential(Mixed(), Mixed())
    assert modeling.get_balanced_memory(model, **kwargs) == hf_modeling.get_balanced_memory(model, **kwargs)


def test_balanced_memory_without_accelerators_keeps_the_budget() -> None:
    # Accelerate 1.15 fails on a "disk" key here (it asks torch for a "disk" device).
    assert modeling.get_balanced_memory(Mixed(), {"cpu": 300, "disk": 1000}) == {"cpu": 300, "disk": 1000}


def test_max_memory() -> None:
    assert modeling.get_max_memory({"disk": "1GB", "cpu": 10, 0: "1KiB"}) == {0: 1024, "cpu": 10, "disk": 10**9}
    with pytest.raises(ValueError, match="tpu is not recognized"):
        modeling.get_max_memory({"tpu": 10})
    measured = modeling.get_max_memory()
    assert measured.get("cpu", measured.get("mps", 0)) > 0


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the machine without an accelerator")
def test_accelerator_index_without_accelerator_is_refused() -> None:
    with pytest.raises(ValueError, match="torch sees no accelerator"):
        resolve_device(0)
    with pytest.raises(ValueError, match="'disk' is where offloaded weights are stored"):
        resolve_device("disk")
    with pytest.raises(ValueError, match="torch sees no accelerator"):
        big_modeling.dispatch_model(nn.Linear(2, 2), {"": 0})


def test_init_empty_weights() -> None:
    with lightning_accel.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
        model[2].weight = model[0].weight
    assert model[0].weight.device.type == "meta" and model[1].running_mean.device.type == "cpu"
    assert model[2].weight is model[0].weight  # HF's init_empty_weights makes a new parameter here: the tie is lost
    register = nn.Module.register_parameter
    with lightning_accel.init_empty_weights(include_buffers=True):
        norm = nn.BatchNorm1d(4)
        assert nn.Module.register_parameter is register
    assert norm.running_mean.device.type == "meta"
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_init_empty_weights_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")
    with lightning_accel.init_empty_weights():
        norm = nn.BatchNorm1d(4)
    assert norm.running_var.device.type == "meta"
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "maybe")
    with pytest.raises(ValueError), lightning_accel.init_empty_weights():
        pass


def test_dispatch_and_load_errors(tmp_path: Path) -> None:
    model = Mixed()
    with pytest.raises(ValueError, match="need an `offload_dir`"):
        big_modeling.dispatch_model(model, {"lin": "disk", "norm": "cpu", "emb": "cpu", "ids": "cpu"})
    with pytest.raises(ValueError, match="does not give any device for the following parameters: ids"):
        big_modeling.dispatch_model(model, {"lin": "cpu", "norm": "cpu", "emb": "cpu"})
    torch.save(model.state_dict() | {"extra": torch.zeros(1)}, tmp_path / "model.bin")
    with pytest.raises(ValueError, match="choose 'auto'"):
        lightning_accel.load_checkpoint_and_dispatch(Mixed(), str(tmp_path / "model.bin"), device_map="fastest")
    with pytest.raises(ValueError, match=r"tensors the model does not: \['extra'\]"):
        lightning_accel.load_checkpoint_in_model(Mixed(), tmp_path / "model.bin", device_map={"": "cpu"}, strict=True)
    with pytest.raises(ValueError, match="offload_folder"):
        lightning_accel.load_checkpoint_in_model(Mixed(), tmp_path / "model.bin", device_map={"": "disk"})
    with pytest.raises(ValueError, match="should be the path to a file"):
        lightning_accel.load_checkpoint_in_model(Mixed(), tmp_path / "nothing")


def test_offloaded_state_dict_includes_root_tensors() -> None:
    # Accelerate 1.15 skips the root module, so a parameter held by the model itself was missing.
    model = Mixed()
    model.root_scale = nn.Parameter(torch.randn(6))
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    big_modeling.cpu_offload(model, execution_device="cpu")
    assert model.lin.weight.device.type == "meta"
    state = modeling.get_state_dict_offloaded_model(model)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())
    assert model.lin.weight.device.type == "meta"


def test_align_module_device_and_state_from_offload() -> None:
    model = Mixed()
    weight = model.lin.weight.detach().clone()
    big_modeling.cpu_offload(model, execution_device="cpu")
    assert modeling.has_offloaded_params(model.lin) and not modeling.has_offloaded_params(nn.Linear(2, 2))
    with modeling.align_module_device(model.lin):
        assert torch.equal(model.lin.weight, weight)
    assert model.lin.weight.device.type == "meta"
    state = modeling.get_state_dict_from_offload(model.lin, "lin.weight", {"lin.weight": None, "lin.bias": None})
    assert torch.equal(state["lin.weight"], weight) and state["lin.bias"] is not None


class AddOne(ModelHook):
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs["shift"] = kwargs.get("shift", 0) + 1
        return args, kwargs


class Shifted(nn.Module):
    def forward(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        return x + shift


def test_hooks_see_keyword_arguments_and_chain() -> None:
    module = Shifted()
    add_hook_to_module(module, AddOne())
    add_hook_to_module(module, AddOne(), append=True)
    assert isinstance(module._hf_hook, SequentialHook)
    assert module(torch.zeros(1), shift=1).item() == 3
    assert module.forward.__name__ == "forward"
    remove_hook_from_module(module)
    assert module(torch.zeros(1)).item() == 0
    assert not hasattr(module, "_hf_hook") and not hasattr(module, "_old_forward")


def test_dispatch_guards_moves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = big_modeling.dispatch_model(
        Mixed(), {"lin": "disk", "norm": "cpu", "emb": "cpu", "ids": "cpu"}, offload_dir=tmp_path
    )
    assert os.path.isfile(tmp_path / "index.json")
    with pytest.raises(RuntimeError, match="offloaded to cpu or disk"):
        model.to("cpu")
    assert "You shouldn't move a model" in caplog.text
    lightning_accel.hooks.remove_hook_from_submodules(model)
    assert "to" not in model.__dict__


def test_hf_hook_removal_understands_our_hooks() -> None:
    # The attribute names are Accelerate's, so its hook removal restores a model offloaded by lightning_accel.
    model = Mixed()
    weight = model.lin.weight.detach().clone()
    big_modeling.cpu_offload(model, execution_device="cpu")
    accelerate.hooks.remove_hook_from_submodules(model)
    assert torch.equal(model.lin.weight, weight) and not hasattr(model.lin, "_hf_hook")


def test_weights_loader_reads_safetensors_entries(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"stored": torch.arange(4.0)}, tmp_path / "w.safetensors")
    entry = {"safetensors_file": str(tmp_path / "w.safetensors"), "weight_name": "stored", "dtype": "float16"}
    for lib in (offload, hf_offload):
        loader = lib.OffloadedWeightsLoader(index={"layer.weight": entry}, device="cpu")
        value = loader["layer.weight"]
        assert value.dtype == torch.float16 and torch.equal(value, torch.arange(4.0).half())
