"""Big-model inference against Hugging Face accelerate 1.15 on a tiny language model.

The model has what device maps are about: a weight tied across the model (embedding and output head), residual
blocks that must not be split (``no_split_module_classes=["Block"]``), a root buffer, and a checkpoint loaded into an
empty (meta) model. Device maps are compared with HF's for several budgets, and every dispatch / offload path is
compared with the un-dispatched model and with HF's own dispatched model.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
from accelerate import big_modeling as hf_big_modeling
from safetensors.torch import save_file
from torch import nn

import lightning_accel
from lightning_accel import big_modeling
from lightning_accel.hooks import remove_hook_from_submodules
from lightning_accel.utils import check_device_map, compute_module_sizes

VOCAB, WIDTH, DEPTH = 32, 16, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def trained_model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():  # non-default values everywhere, LayerNorm affine included
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


IDS = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
TOTAL = compute_module_sizes(TinyLM())[""]


@pytest.fixture(scope="module")
def reference() -> tuple[TinyLM, torch.Tensor]:
    model = trained_model()
    with torch.no_grad():
        return model, model(IDS)


BUDGETS: list[dict[str, Any]] = [
    {"max_memory": {"cpu": TOTAL * 2}},
    {"max_memory": {"cpu": TOTAL // 2}},
    {"max_memory": {"cpu": TOTAL // 4, "disk": TOTAL}},
    {"max_memory": {0: TOTAL // 3, "cpu": TOTAL // 3}},
    {"max_memory": {0: TOTAL // 5, 1: TOTAL // 4, "cpu": TOTAL // 4}},
    {"max_memory": {"cpu": TOTAL // 3}, "dtype": torch.float16},
    {"max_memory": {"cpu": TOTAL // 2}, "special_dtypes": {"blocks.1.up.weight": torch.float16}},
    {"max_memory": {0: TOTAL // 3, "cpu": TOTAL // 3}, "offload_buffers": True},
    {"max_memory": {0: 600, "cpu": TOTAL // 2}, "fallback_allocation": True},
    {"max_memory": {"cpu": "5KB"}, "clean_result": False},
]


@pytest.mark.parametrize("no_split", [["Block"], None])
@pytest.mark.parametrize("kwargs", BUDGETS, ids=[str(i) for i in range(len(BUDGETS))])
def test_device_maps_equal_hf(kwargs: dict[str, Any], no_split: list[str] | None) -> None:
    model = TinyLM()
    ours = lightning_accel.infer_auto_device_map(model, no_split_module_classes=no_split, **kwargs)
    theirs = accelerate.infer_auto_device_map(model, no_split_module_classes=no_split, **kwargs)
    assert ours == dict(theirs)
    check_device_map(model, ours)
    if no_split:
        assert not any(key.count(".") > 1 for key in ours), "a Block was split"


def _save(model: nn.Module, folder: Path, form: str) -> str:
    """``model``'s state dict as one ``.bin``, one ``.safetensors``, or safetensors shards with an index."""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "head.weight"}
    if form == "bin":
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        return str(folder / "pytorch_model.bin")
    if form == "safetensors":
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return str(folder)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        shards.setdefault(f"model-{len(shards) % 3 if name.startswith('blocks') else 9}.safetensors", {})[name] = tensor
    for file, tensors in shards.items():
        save_file(tensors, folder / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder / "model.safetensors.index.json")


def _empty(init_empty_weights: Callable[..., Any]) -> TinyLM:
    with init_empty_weights():
        model = TinyLM()
    model.head.weight = model.embed.weight  # HF's init_empty_weights unties it (as transformers' tie_weights does)
    return model.eval()


@pytest.fixture
def fast_hf_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's load_checkpoint_in_model runs a full gc.collect() per shard (~0.6 s here); skipped, results unchanged."""
    monkeypatch.setattr(gc, "collect", lambda *args: 0)


# Accelerate 1.15 fails where noted: a safetensors checkpoint read for a map whose only device is "disk" (it asks
# safetensors for device "disk"), and a root buffer offloaded with offload_buffers=True (left on the meta device).
DISPATCHES: list[tuple[dict[str, Any], str | None]] = [
    ({"device_map": "auto", "max_memory": {"cpu": TOTAL // 2}, "no_split_module_classes": ["Block"]}, None),
    ({"device_map": "sequential", "max_memory": {"cpu": TOTAL // 2}, "no_split_module_classes": ["Block"]}, None),
    ({"device_map": "balanced", "max_memory": {"cpu": TOTAL // 3}}, None),
    ({"device_map": {"embed": "cpu", "blocks": "disk", "final_norm": "cpu", "head": "cpu", "scale": "cpu"}}, None),
    ({"device_map": {"": "disk"}}, "SafetensorError"),
    (
        {"device_map": "auto", "max_memory": {"cpu": TOTAL // 3}, "offload_buffers": True, "dtype": "float16"},
        "ValueError",
    ),
]
# Every map from safetensors; the other checkpoint forms (one .bin, safetensors shards with an index) on two of them.
CASES = (
    [(kwargs, "safetensors", fails) for kwargs, fails in DISPATCHES]
    + [(*DISPATCHES[0][:1], form, None) for form in ("bin", "sharded")]
    + [(*DISPATCHES[3][:1], "sharded", None), (*DISPATCHES[4][:1], "bin", None)]
)


@pytest.mark.usefixtures("fast_hf_loading")
@pytest.mark.parametrize(("kwargs", "form", "hf_fails"), CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_load_checkpoint_and_dispatch_reproduces_outputs(
    tmp_path: Path, reference: tuple[TinyLM, torch.Tensor], kwargs: dict[str, Any], form: str, hf_fails: str | None
) -> None:
    full, expected = reference
    checkpoint = _save(full, tmp_path, form)
    ours = lightning_accel.load_checkpoint_and_dispatch(
        _empty(lightning_accel.init_empty_weights), checkpoint, offload_folder=str(tmp_path / "ours"), **kwargs
    )
    with torch.no_grad():
        output = ours(IDS)
    tolerance = 2e-2 if "dtype" in kwargs else 0.0
    torch.testing.assert_close(output.float(), expected, rtol=tolerance, atol=tolerance)
    assert ours.head.weight is ours.embed.weight or ours.head.weight.device.type == "meta"

    def hf_dispatched() -> nn.Module:
        return accelerate.load_checkpoint_and_dispatch(
            _empty(accelerate.init_empty_weights), checkpoint, offload_folder=str(tmp_path / "theirs"), **kwargs
        )

    if hf_fails is not None:
        with pytest.raises(Exception) as raised:
            hf_dispatched()(IDS)
        assert type(raised.value).__name__ == hf_fails
        return
    theirs = hf_dispatched()
    assert ours.hf_device_map == theirs.hf_device_map
    with torch.no_grad():
        assert torch.equal(output, theirs(IDS))
    if "disk" in ours.hf_device_map.values():
        assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "theirs"))


@pytest.mark.parametrize("offload_buffers", [False, True])
def test_cpu_and_disk_offload_reproduce_outputs(
    tmp_path: Path, reference: tuple[TinyLM, torch.Tensor], offload_buffers: bool
) -> None:
    _, expected = reference
    runs = {
        "cpu": lambda lib, model: lib.cpu_offload(model, execution_device="cpu", offload_buffers=offload_buffers),
        "disk": lambda lib, model: lib.disk_offload(
            model, tmp_path / f"{lib.__name__}", execution_device="cpu", offload_buffers=offload_buffers
        ),
    }
    for kind, run in runs.items():
        outputs = []
        for lib in (big_modeling, hf_big_modeling):
            model = trained_model()
            run(lib, model)
            assert model.blocks[0].up.weight.device.type == "meta"
            assert (model.scale.device.type == "meta") is offload_buffers
            with torch.no_grad():
                outputs.append(model(IDS))
        assert torch.equal(outputs[0], outputs[1]), kind
        torch.testing.assert_close(outputs[0], expected, rtol=0, atol=0)


def test_removing_offload_hooks_restores_the_model(reference: tuple[TinyLM, torch.Tensor]) -> None:
    _, expected = reference
    model = big_modeling.cpu_offload(trained_model(), execution_device="cpu")
    remove_hook_from_submodules(model)
    assert all(param.device.type == "cpu" for param in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), expected, rtol=0, atol=0)


def test_dispatch_keeps_tied_weights_shared(tmp_path: Path, reference: tuple[TinyLM, torch.Tensor]) -> None:
    full, expected = reference
    checkpoint = _save(full, tmp_path, "safetensors")
    model = lightning_accel.load_checkpoint_and_dispatch(
        _empty(lightning_accel.init_empty_weights), checkpoint, device_map={"": "cpu"}
    )
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.device.type == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), expected, rtol=0, atol=0)


def test_disk_offloaded_module_keeps_its_checkpoint_buffers(tmp_path: Path) -> None:
    # Accelerate 1.15 leaves a non-offloaded buffer of a "disk" module as the model was built (BatchNorm's running
    # statistics stay 0/1 here); ours loads the checkpoint's values.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.bn, self.l2 = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l2(self.bn(self.l1(x)))

    torch.manual_seed(0)
    net = Net()
    net(torch.randn(16, 4) * 3 + 1)  # running statistics move away from their initial values
    net.eval()
    x = torch.randn(3, 4)
    torch.save(net.state_dict(), tmp_path / "net.bin")
    with lightning_accel.init_empty_weights():
        empty = Net()
    loaded = lightning_accel.load_checkpoint_and_dispatch(
        empty.eval(), tmp_path / "net.bin", device_map={"l1": "cpu", "bn": "disk", "l2": "cpu"}, offload_folder=tmp_path
    )
    torch.testing.assert_close(loaded.bn.running_mean, net.bn.running_mean)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)


def test_split_module_buffers_get_a_device(tmp_path: Path) -> None:
    # Accelerate 1.15 leaves "1.scale" out when "1" is split across devices, and check_device_map refuses its map.
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((8,), 2.0))
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Holder(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    device_map = lightning_accel.infer_auto_device_map(model, max_memory={"cpu": 900})
    assert device_map == {"0": "cpu", "1.a": "cpu", "1.b": "disk", "2": "disk", "1.scale": "cpu"}
    dispatched = big_modeling.dispatch_model(model, device_map, offload_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(dispatched(x), expected, rtol=0, atol=0)


def test_tied_weight_inside_a_nested_module_stays_together() -> None:
    # Accelerate 1.15 reads "0" as containing "1.0.weight" (substring match) and fails with an IndexError here.
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 8))
    model[2].weight = model[1][0].weight
    for budget in (300, 700, 1100):
        device_map = lightning_accel.infer_auto_device_map(model, max_memory={"cpu": budget})
        devices = {"1": device_map.get("1", device_map.get("")), "2": device_map.get("2", device_map.get(""))}
        assert devices["1"] == devices["2"], device_map


def test_layerwise_casting_matches_hf(reference: tuple[TinyLM, torch.Tensor]) -> None:
    _, expected = reference
    outputs = []
    for lib in (big_modeling, hf_big_modeling):
        model = trained_model()
        lib.attach_layerwise_casting_hooks(model, torch.float16, torch.float32, skip_modules_pattern=["head"])
        assert model.blocks[0].up.weight.dtype == torch.float16
        assert model.head.weight.dtype == torch.float32
        with torch.no_grad():
            outputs.append(model(IDS))
        assert model.blocks[0].up.weight.dtype == torch.float16
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], expected, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dispatch_over_gpu_cpu_and_disk_matches_hf(tmp_path: Path, reference: tuple[TinyLM, torch.Tensor]) -> None:
    full, expected = reference
    checkpoint = _save(full, tmp_path, "safetensors")
    kwargs: dict[str, Any] = {
        "device_map": "auto",
        "max_memory": {0: TOTAL // 3, "cpu": TOTAL // 3},
        "no_split_module_classes": ["Block"],
    }
    ours = lightning_accel.load_checkpoint_and_dispatch(
        _empty(lightning_accel.init_empty_weights), checkpoint, offload_folder=tmp_path / "ours", **kwargs
    )
    theirs = accelerate.load_checkpoint_and_dispatch(
        _empty(accelerate.init_empty_weights), checkpoint, offload_folder=tmp_path / "theirs", **kwargs
    )
    assert ours.hf_device_map == theirs.hf_device_map
    assert set(ours.hf_device_map.values()) == {0, "cpu", "disk"}
    with torch.no_grad():
        output = ours(IDS)
        assert output.device.type == "cpu"
        torch.testing.assert_close(output, theirs(IDS))
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_accelerator_save_model_of_a_disk_offloaded_model_matches_hf(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.helpers import reset_accelerator_states

    files = {}
    for name, lib in (("ours", lightning_accel), ("theirs", accelerate)):
        reset_accelerator_states()
        model = trained_model()
        lib.big_modeling.disk_offload(model, tmp_path / f"offload_{name}", execution_device="cpu")
        assert model.blocks[0].up.weight.device.type == "meta"
        lib.Accelerator(cpu=True).save_model(model, tmp_path / name)
        files[name] = load_file(tmp_path / name / "model.safetensors")
    reset_accelerator_states()
    expected = trained_model().state_dict()
    # HF drops the root module's own buffer (``scale``) from an offloaded model's state; ours keeps every tensor.
    assert set(files["ours"]) == set(expected)
    assert set(files["theirs"]) == set(files["ours"]) - {"scale"}
    for key, tensor in files["ours"].items():
        assert torch.equal(tensor, expected[key]), key
        assert key not in files["theirs"] or torch.equal(files["theirs"][key], tensor), key
