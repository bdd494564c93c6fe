"""bitsandbytes quantization (``load_and_quantize_model``) on the CPU, against HF accelerate's pieces and plain torch.

HF accelerate 1.15's ``load_and_quantize_model`` refuses a machine without CUDA/XPU, so on the CPU the reference is
HF's own layer replacement (``accelerate.utils.bnb.replace_with_bnb_layers`` with HF's default skip list) quantized
by bitsandbytes' ``.to("cpu")``; the GPU test at the end compares the two functions themselves.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_accel.utils.bnb as ours_bnb
from lightning_accel import init_empty_weights
from lightning_accel.utils import BnbQuantizationConfig, has_4bit_bnb_layers, load_and_quantize_model

bnb = pytest.importorskip("bitsandbytes")
hf_bnb = pytest.importorskip("accelerate.utils.bnb")
import accelerate  # noqa: E402

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.block = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.mid = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.block(self.embed(ids)))))


class TiedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight  # (32, 64): an lm head tied to the embeddings


def _checkpoint(tmp_path: Path, model: nn.Module) -> str:
    os.makedirs(tmp_path, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path)


def _reference(model: nn.Module, config: BnbQuantizationConfig) -> nn.Module:
    """HF's layer replacement and dtype cast, quantized by bitsandbytes on the CPU (HF's loaded-model path)."""
    hf_config = accelerate.utils.BnbQuantizationConfig(
        load_in_8bit=config.load_in_8bit, load_in_4bit=config.load_in_4bit, torch_dtype=config.torch_dtype,
        bnb_4bit_compute_dtype=config.bnb_4bit_compute_dtype, bnb_4bit_quant_type=config.bnb_4bit_quant_type,
    )  # fmt: skip
    reference = copy.deepcopy(model)
    skip = config.skip_modules if config.skip_modules is not None else hf_bnb.get_keys_to_not_convert(reference)
    reference = hf_bnb.replace_with_bnb_layers(reference, hf_config, modules_to_not_convert=skip)
    for param in reference.parameters():
        if torch.is_floating_point(param):
            param.data = param.data.to(config.torch_dtype)  # type: ignore[arg-type]
    return reference.to("cpu")


def _quantized(model_cls: type[nn.Module], state_from: nn.Module, tmp_path: Path, config: BnbQuantizationConfig, **kw):  # type: ignore[no-untyped-def]
    location = _checkpoint(tmp_path, state_from)
    with init_empty_weights():
        empty = model_cls()
    return load_and_quantize_model(empty, config, weights_location=location, **kw)


IDS = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))


def test_8bit_on_cpu_matches_hf_layers_and_plain_int8_rowwise_quantization(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32)
    ours = _quantized(Net, model, tmp_path, config, device_map={"": "cpu"})
    assert isinstance(ours.block[0], bnb.nn.Linear8bitLt) and isinstance(ours.mid, bnb.nn.Linear8bitLt)
    assert type(ours.head) is nn.Linear  # HF's default: the last module stays unquantized
    assert ours.is_loaded_in_8bit and not ours.is_loaded_in_4bit
    assert ours.block[0].weight.dtype == torch.int8 and ours.block[0].weight.device.type == "cpu"

    # The int8 weights are LLM.int8()'s row-wise quantization of the fp16 weights, computed here with plain torch.
    weight = model.block[0].weight.detach().half().float()
    scale = weight.abs().amax(dim=1)
    torch.testing.assert_close(ours.block[0].weight.SCB.float(), scale, rtol=1e-3, atol=0)
    expected = torch.round(weight * (127.0 / scale[:, None])).to(torch.int8)
    assert (ours.block[0].weight.data.int() - expected.int()).abs().max() <= 1

    with torch.no_grad():
        out, full, reference = ours(IDS), model(IDS), _reference(model, config)(IDS)
    assert torch.equal(out, reference)
    assert (out - full).abs().max() < 0.02 * full.abs().max()  # close to fp32, not equal to it
    assert not torch.equal(out, full)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_on_cpu_matches_hf_layers(tmp_path: Path, quant_type: str) -> None:
    torch.manual_seed(0)
    model = Net()
    config = BnbQuantizationConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32
    )
    ours = _quantized(Net, model, tmp_path, config)  # device_map=None: the CPU on a machine without accelerator
    assert has_4bit_bnb_layers(ours) and hf_bnb.has_4bit_bnb_layers(ours)
    assert ours.block[0].weight.dtype == torch.uint8 and ours.block[0].weight.quant_state.quant_type == quant_type
    with torch.no_grad():
        out, full, reference = ours(IDS), model(IDS), _reference(model, config)(IDS)
    assert torch.equal(out, reference)
    assert (out - full).abs().max() < 0.25 * full.abs().max()
    assert not has_4bit_bnb_layers(Net())


def test_skip_modules_and_keep_in_fp32_modules(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    config = BnbQuantizationConfig(
        load_in_8bit=True, torch_dtype=torch.float16, skip_modules=["block.2"], keep_in_fp32_modules=["mid"]
    )
    ours = _quantized(Net, model, tmp_path, config, device_map={"": "cpu"})
    assert isinstance(ours.block[0], bnb.nn.Linear8bitLt) and isinstance(ours.head, bnb.nn.Linear8bitLt)
    assert type(ours.block[2]) is nn.Linear and ours.block[2].weight.dtype == torch.float16
    assert type(ours.mid) is nn.Linear and ours.mid.weight.dtype == torch.float32
    assert ours.embed.weight.dtype == torch.float16
    assert config.skip_modules == ["block.2"]  # the caller's config is left as passed
    torch.testing.assert_close(ours.mid.weight, model.mid.weight)


@pytest.mark.parametrize("model_cls", [Net, TiedNet])
def test_default_skip_list_is_hfs(model_cls: type[nn.Module]) -> None:
    model = model_cls()
    assert sorted(ours_bnb.get_keys_to_not_convert(model)) == sorted(hf_bnb.get_keys_to_not_convert(model))

    class Base(Net):
        base_model_prefix = "transformer"  # a transformers base model (no head attribute of that name)

    assert ours_bnb.get_keys_to_not_convert(Base()) == hf_bnb.get_keys_to_not_convert(Base()) == []


def test_8bit_disk_offload_gives_the_in_memory_outputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32)
    in_memory = _quantized(Net, model, tmp_path / "a", config, device_map={"": "cpu"})
    device_map = {"embed": "cpu", "block": "disk", "mid": "disk", "head": "cpu"}
    offload = tmp_path / "offload"
    offloaded = _quantized(Net, model, tmp_path / "b", config, device_map=device_map, offload_folder=offload)
    assert offloaded.block[0].weight.device.type == "meta"
    files = {path.name for path in offload.iterdir()}
    assert {"block.0.weight.dat", "block.0.SCB.dat", "mid.SCB.dat", "block.0.bias.dat"} <= files
    with torch.no_grad():
        assert torch.equal(offloaded(IDS), in_memory(IDS))
        assert torch.equal(offloaded(IDS), in_memory(IDS))  # the weights went back to disk and came again
    assert offloaded.block[0].weight.device.type == "meta"


def test_quantized_device_map_matches_hfs(tmp_path: Path) -> None:
    config = BnbQuantizationConfig(load_in_8bit=True)
    hf_config = accelerate.utils.BnbQuantizationConfig(load_in_8bit=True)
    for budget in (6_000, 15_000):
        with init_empty_weights():
            ours_model, hf_model = Net(), Net()
        skip = ours_bnb.get_keys_to_not_convert(ours_model)
        hf_config.skip_modules, hf_config.keep_in_fp32_modules = list(skip), []
        with init_empty_weights():
            ours_bnb.replace_with_bnb_layers(ours_model, config, modules_to_not_convert=skip)
        with accelerate.init_empty_weights():
            hf_bnb.replace_with_bnb_layers(hf_model, hf_config, modules_to_not_convert=skip)
        max_memory = {"cpu": budget}
        ours = ours_bnb.get_quantized_model_device_map(ours_model, config, "sequential", max_memory=max_memory)
        hf = hf_bnb.get_quantized_model_device_map(hf_model, hf_config, "sequential", max_memory=max_memory)
        assert ours == hf and "disk" in ours.values()


def test_4bit_offload_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = BnbQuantizationConfig(load_in_4bit=True)
    with init_empty_weights():
        model = ours_bnb.replace_with_bnb_layers(Net(), config, modules_to_not_convert=["head"])
    with pytest.raises(ValueError, match=r"4-bit modules \['block'\] would be offloaded.*skip_modules"):
        ours_bnb.get_quantized_model_device_map(
            model, config, {"embed": "cpu", "block": "disk", "mid": "cpu", "head": "cpu"},
            modules_to_not_convert=["head"],
        )  # fmt: skip


def test_device_without_kernels_and_missing_bitsandbytes_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bitsandbytes 0.50 registers pure-torch default kernels that any device can run (0.50.2 no CPU-only one for this
    # op): CPU dispatch reaches one.
    assert ours_bnb.bnb_supports_device("8-bit", "cpu") and ours_bnb.bnb_supports_device("4-bit", "cpu")
    assert torch._C._dispatch_has_computed_kernel_for_dispatch_key("bitsandbytes::int8_linear_matmul", "CPU")
    with pytest.raises(ValueError, match="mode must be one of"):
        ours_bnb.bnb_supports_device("3-bit", "cpu")
    torch.manual_seed(0)
    location = _checkpoint(tmp_path, Net())
    with init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match="pass `weights_location`"):
        load_and_quantize_model(model, BnbQuantizationConfig(load_in_8bit=True))
    # No device lacks kernels with this bitsandbytes, so an older one's answer is stood in for the message.
    monkeypatch.setattr(ours_bnb, "bnb_supports_device", lambda mode, device: torch.device(device).type == "cuda")
    with pytest.raises(ValueError, match=r"no 8-bit kernels for device 'cpu'.*CUDA device.*pip install -U"):
        load_and_quantize_model(model, BnbQuantizationConfig(load_in_8bit=True), location, device_map={"": "cpu"})
    # Without bitsandbytes installed (not uninstallable here: the availability check is what reports it).
    monkeypatch.setattr(ours_bnb, "is_bnb_available", lambda: False)
    with pytest.raises(ImportError, match=r"not installed: `pip install bitsandbytes`"):
        load_and_quantize_model(Net(), BnbQuantizationConfig(load_in_4bit=True), location)


def test_quantizing_a_loaded_model_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Net()
    config = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float32)
    reference = _reference(model, config)
    with caplog.at_level(logging.WARNING):
        ours = load_and_quantize_model(copy.deepcopy(model), config)
    assert "not recommended to quantize a loaded model" in caplog.text
    with torch.no_grad():
        assert torch.equal(ours(IDS), reference(IDS))


def test_set_module_tensor_to_device_quantizes_bnb_parameters_as_bitsandbytes_does() -> None:
    from lightning_accel.utils import set_module_tensor_to_device

    torch.manual_seed(0)
    weight = torch.randn(16, 8)
    layer = bnb.nn.Linear8bitLt(8, 16, has_fp16_weights=False)
    set_module_tensor_to_device(layer, "weight", "cpu", value=weight)
    expected = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False).to("cpu")
    assert type(layer.weight) is bnb.nn.Int8Params and torch.equal(layer.weight.data, expected.data)
    assert torch.equal(layer.weight.SCB, expected.SCB)
    set_module_tensor_to_device(layer, "weight", "meta")  # what an offload hook does after the forward
    assert layer.weight.device.type == "meta" and type(layer.weight) is bnb.nn.Int8Params


def test_availability_flags_match_hfs() -> None:
    from accelerate.utils import imports as hf_imports

    from lightning_accel.utils import is_4bit_bnb_available, is_8bit_bnb_available, is_bnb_available

    assert is_bnb_available() == hf_imports.is_bnb_available() is True
    assert is_4bit_bnb_available() == hf_imports.is_4bit_bnb_available()
    assert is_8bit_bnb_available() == hf_imports.is_8bit_bnb_available()
    assert is_bnb_available("99.0") is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_cuda_matches_hf_load_and_quantize_model(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = Net()
    kwargs = {"load_in_8bit": True} if mode == "8bit" else {"load_in_4bit": True}
    location = _checkpoint(tmp_path, model)
    with init_empty_weights():
        ours_model, hf_model = Net(), Net()
    ours = load_and_quantize_model(ours_model, BnbQuantizationConfig(**kwargs), location)
    hf = accelerate.utils.load_and_quantize_model(hf_model, accelerate.utils.BnbQuantizationConfig(**kwargs), location)
    ids = IDS.cuda()
    with torch.no_grad():
        assert torch.equal(ours(ids), hf(ids))
