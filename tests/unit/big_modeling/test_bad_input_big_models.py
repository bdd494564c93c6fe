"""Big-model mistakes refused naming the offending value and the fix (issue 23).

HF accelerate 1.15 takes each of these silently or fails deep inside torch: an unknown ``no_split_module_classes``
name is ignored; a device map naming ``cuda:3`` on a machine without it ends in torch's ``AssertionError`` (or
``RuntimeError``) when a tensor is moved; a key naming no module of the model only warns (``check_device_map``); a
shape mismatch names the leaf (``bias``), not the tensor (``head.bias``), nor the file; a tensor the checkpoint lacks
stays on the meta device until torch fails with "Cannot copy out of meta tensor"; a truncated file raises torch's
``PytorchStreamReader`` or safetensors' header error without the path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_accel
from lightning_accel.big_modeling import dispatch_model, load_checkpoint_and_dispatch
from lightning_accel.utils import (
    check_device_map,
    get_balanced_memory,
    infer_auto_device_map,
    load_checkpoint_in_model,
    set_module_tensor_to_device,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


class Net(nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _save(model: nn.Module, path: Path, drop: str | None = None) -> Path:
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != drop}
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def test_no_split_class_the_model_lacks_is_refused_naming_it() -> None:
    model = Net()
    budget = {"cpu": 10**9}
    with pytest.raises(ValueError, match=r"no_split_module_classes names \['Blok'\].*\(Net\).*'Block'"):
        infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block", "Blok"])
    with pytest.raises(ValueError, match=r"names \['LlamaDecoderLayer'\]"):
        get_balanced_memory(model, max_memory=budget, no_split_module_classes="LlamaDecoderLayer")
    # A class object instead of its name would never match a module: refused with the name to pass.
    with pytest.raises(TypeError, match=r"must hold class names \(strings\).*\['Block'\]"):
        infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[Block])  # type: ignore[list-item]
    assert infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"]) == {"": "cpu"}


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="needs a machine without a cuda:3")
def test_a_device_the_machine_lacks_is_refused_naming_it_and_the_devices_there() -> None:
    model = Net()
    existing = [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu", "disk"]
    message = f"Device 'cuda:3' does not exist on this machine; the devices here are {existing!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        dispatch_model(model, {"body": "cpu", "head": "cuda:3"})
    assert model.head.weight.device.type == "cpu"  # refused before anything moved
    with pytest.raises(ValueError, match=r"Device 'cuda:3' does not exist"):
        set_module_tensor_to_device(model, "head.bias", "cuda:3")
    with pytest.raises(ValueError, match=r"Device 'cpu1' is not a device torch knows"):
        dispatch_model(model, {"body": "cpu", "head": "cpu1"})


def test_check_device_map_refuses_a_key_naming_no_module() -> None:
    """Accelerate 1.15 warns (UserWarning) and goes on; the misspelt module then has no device of its own."""
    model = Net()
    with pytest.raises(ValueError, match=r"device_map keys \['haed'\] match no submodule.*\['body', 'head'\]"):
        check_device_map(model, {"body": "cpu", "head": "cpu", "haed": "cpu"})
    with pytest.raises(ValueError, match=r"\['haed'\] match no submodule"):
        dispatch_model(model, {"body": "cpu", "haed": "cpu"})
    check_device_map(
        model, {"body.0": "cpu", "body.1.linear.weight": "cpu", "body.1.linear.bias": "cpu", "head": "cpu"}
    )


def test_shape_mismatch_names_the_full_tensor_name_and_the_file(tmp_path: Path) -> None:
    checkpoint = _save(Net(out=5), tmp_path / "model.safetensors")
    with lightning_accel.init_empty_weights():
        model = Net(out=3)
    pattern = rf"{checkpoint} holds 'head\.bias' with shape \(5,\), but the model's 'head\.bias' has shape \(3,\)"
    with pytest.raises(ValueError, match=pattern):
        load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"})
    with pytest.raises(ValueError, match=pattern):  # without a device map too (torch's own message lacks the file)
        load_checkpoint_in_model(Net(out=3), checkpoint)
    with pytest.raises(ValueError, match=r'in "head\.bias" \(which has shape'):
        set_module_tensor_to_device(Net(out=3), "head.bias", "cpu", value=torch.zeros(5))


def test_a_tensor_missing_from_the_checkpoint_is_refused_naming_it_and_the_file(tmp_path: Path) -> None:
    reference = Net()
    checkpoint = _save(reference, tmp_path / "model.safetensors", drop="head.bias")
    with lightning_accel.init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match=rf"\['head\.bias'\] are not in {checkpoint}, so they have no data"):
        load_checkpoint_in_model(model, checkpoint, device_map={"body": "cpu", "head": "cpu"})
    with lightning_accel.init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match=r"\['head\.bias'\] are not in"):
        load_checkpoint_and_dispatch(model, checkpoint, device_map={"": "cpu"})
    # A complete checkpoint, the same model: loads and computes as the reference does.
    complete = _save(reference, tmp_path / "complete.safetensors")
    with lightning_accel.init_empty_weights():
        model = Net()
    load_checkpoint_in_model(model, complete, device_map={"body": "cpu", "head": "cpu"})
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), reference(x))


def test_a_missing_tensor_offloaded_to_disk_is_refused_too(tmp_path: Path) -> None:
    checkpoint = _save(Net(), tmp_path / "model.safetensors", drop="body.1.linear.weight")
    with lightning_accel.init_empty_weights():
        model = Net()
    device_map = {"body.0": "cpu", "body.1": "disk", "head": "cpu"}
    with pytest.raises(ValueError, match=r"\['body\.1\.linear\.weight'\] are not in"):
        load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=tmp_path / "offload")


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_checkpoint_file_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.endswith(".safetensors"):
        _save(Net(), path)
    else:
        torch.save(Net().state_dict(), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"Could not read checkpoint file {path}: .*truncated or corrupt"):
        load_checkpoint_in_model(Net(), tmp_path)
    with lightning_accel.init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match=rf"Could not read checkpoint file {path}"):
        load_checkpoint_in_model(model, path, device_map={"body": "cpu", "head": "cpu"})


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="needs a machine without a cuda:3")
def test_offloading_to_an_absent_execution_device_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model = Net()
    for offload in (
        lambda: lightning_accel.cpu_offload(model, execution_device="cuda:3"),
        lambda: lightning_accel.cpu_offload_with_hook(model, execution_device="cuda:3"),
        lambda: lightning_accel.disk_offload(model, tmp_path / "offload", execution_device="cuda:3"),
        lambda: dispatch_model(model, {"body": "cpu", "head": "disk"}, main_device="cuda:3", offload_dir=tmp_path),
    ):
        with pytest.raises(ValueError, match=r"Device 'cuda:3' does not exist on this machine"):
            offload()
    assert not (tmp_path / "offload").exists()
    assert model.head.weight.device.type == "cpu"
    with lightning_accel.init_on_device("cpu"):
        pass
    with pytest.raises(ValueError, match=r"Device 'cuda:3' does not exist"), lightning_accel.init_on_device("cuda:3"):
        pass
