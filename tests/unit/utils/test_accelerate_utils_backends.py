"""The DeepSpeed, torchao and Transformer Engine helpers of ``accelerate.utils``, checked against HF accelerate 1.15.

The DeepSpeed config questions, engine wrapper and optimizer mapping; torchao's module filters and fp8 conversion;
the Transformer Engine helpers' refusal without the package. The other helpers are in ``test_accelerate_utils_more.py``.
"""

from __future__ import annotations

import base64
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate.utils as hf
import pytest
import torch
from torch import nn

from lightning_accel import utils as ours


def _shape(module: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in module.named_modules()]


# ---- DeepSpeed ----------------------------------------------------------------------------------------------------

_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}},
    "bf16": {"enabled": True},
    "gradient_clipping": 0.0,
}


def _ds_questions(config: Any) -> dict[str, Any]:
    return {
        "stage": config.get_value("zero_optimization.stage"),
        "zero2": config.is_zero2(),
        "zero3": config.is_zero3(),
        "offload": config.is_offload(),
        "missing": config.get_value("a.b.c", "default"),
        "bf16_true": config.is_true("bf16.enabled"),
        "clip_false": config.is_false("gradient_clipping"),
        "unset_true": config.is_true("fp16.enabled"),
        "node": config.find_config_node("zero_optimization.offload_param.device"),
    }


def test_hf_deepspeed_config_as_hf(tmp_path: Path) -> None:
    from accelerate.utils.deepspeed import HfDeepSpeedConfig as HFConfig

    (tmp_path / "ds.json").write_text(json.dumps(_DS_CONFIG))
    text = json.dumps(_DS_CONFIG)
    inputs = [_DS_CONFIG, str(tmp_path / "ds.json"), text, base64.urlsafe_b64encode(text.encode()).decode()]
    inputs.append({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    inputs.append({})
    for given in inputs:
        mine, theirs = ours.HfDeepSpeedConfig(given), HFConfig(given)
        assert mine.config == theirs.config
        assert _ds_questions(mine) == _ds_questions(theirs)
        for config in (mine, theirs):
            config.del_config_sub_tree("zero_optimization.offload_param")
            config.del_config_sub_tree("not.there")
        assert mine.config == theirs.config
    assert _DS_CONFIG["zero_optimization"]["offload_param"] == {"device": "cpu"}  # the caller's dict is copied
    for library in (ours, SimpleNamespace(HfDeepSpeedConfig=HFConfig)):
        with pytest.raises(ValueError, match="Expected a string path to an existing deepspeed config"):
            library.HfDeepSpeedConfig("{not json")
        with pytest.raises(ValueError, match="Can't find"):
            library.HfDeepSpeedConfig({}).del_config_sub_tree("x.y", must_exist=True)


class _Recorder:
    """A DeepSpeed engine stand-in recording the calls a wrapper makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.calls.append(("boundary", is_boundary))

    def backward(self, loss: Any, **kwargs: Any) -> None:
        self.calls.append(("backward", (loss, kwargs)))

    def step(self) -> None:
        self.calls.append(("step", None))

    def get_global_grad_norm(self) -> torch.Tensor:
        return torch.tensor(1.5)


def test_deepspeed_engine_wrapper_as_hf() -> None:
    pytest.importorskip("deepspeed")
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper as HFWrapper

    engines = []
    for wrapper_class in (ours.DeepSpeedEngineWrapper, HFWrapper):
        engine = _Recorder()
        wrapper = wrapper_class(engine)
        wrapper.backward("loss-1", sync_gradients=False, retain_graph=True)
        wrapper.backward("loss-2")
        assert wrapper.get_global_grad_norm() == 1.5
        engines.append(engine.calls)
    assert engines[0] == engines[1]
    assert ("step", None) in engines[0]


def test_map_pytorch_optim_to_deepspeed_as_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    import deepspeed.ops.adagrad
    import deepspeed.ops.adam
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed as hf_map

    def recorder(name: str) -> type:
        return type(name, (), {"__init__": lambda self, groups, **kwargs: setattr(self, "seen", (groups, kwargs))})

    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", recorder("DeepSpeedCPUAdam"))
    monkeypatch.setattr(deepspeed.ops.adagrad, "DeepSpeedCPUAdagrad", recorder("DeepSpeedCPUAdagrad"))
    params = [nn.Parameter(torch.ones(2))]
    for optimizer in (
        torch.optim.AdamW(params, lr=0.1, weight_decay=0.2),
        torch.optim.Adam(params, lr=0.3),
        torch.optim.Adagrad(params, lr=0.4),
        torch.optim.SGD(params, lr=0.5),
    ):
        mine, theirs = ours.map_pytorch_optim_to_deepspeed(optimizer), hf_map(optimizer)
        assert type(mine).__name__ == type(theirs).__name__
        assert mine.seen[1] == theirs.seen[1]
        assert mine.seen[0] is theirs.seen[0] is optimizer.param_groups


# ---- torchao and Transformer Engine -------------------------------------------------------------------------------


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.middle = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 20))
        self.last = nn.Linear(20, 16)


def test_ao_filters_as_hf() -> None:
    import accelerate.utils.ao as hf_ao

    import lightning_accel.utils.ao as our_ao

    model = _Wide()
    assert our_ao.find_first_last_linear_layers(model) == hf_ao.find_first_last_linear_layers(model)
    for name, module in model.named_modules():
        for skip in ([], ["first"], [name]):
            assert our_ao.filter_linear_layers(module, name, skip) == hf_ao.filter_linear_layers(module, name, skip)
        assert ours.filter_first_and_last_linear_layers(module, name) == hf.filter_first_and_last_linear_layers(
            module, name
        )


def test_convert_model_to_fp8_ao_as_hf() -> None:
    pytest.importorskip("torchao")
    converted = []
    for library in (ours, hf):
        model = _Wide()
        assert not library.has_ao_layers(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            library.convert_model_to_fp8_ao(model)
        assert library.has_ao_layers(model)
        converted.append(_shape(model))
    assert converted[0] == converted[1]
    assert dict(converted[0])["middle.0"] == "Float8Linear"  # the first, last and non-multiple-of-16 layers stay
    assert dict(converted[0])["first"] == dict(converted[0])["last"] == dict(converted[0])["middle.1"] == "Linear"


@pytest.mark.skipif("transformer_engine" in sys.modules or ours.is_transformer_engine_available(), reason="TE here")
def test_transformer_engine_helpers_need_transformer_engine() -> None:
    model = nn.Linear(16, 16)
    calls = [
        lambda lib: lib.convert_model(model),
        lambda lib: lib.has_transformer_engine_layers(model),
        lambda lib: lib.contextual_fp8_autocast(model.forward, None),
        lambda lib: lib.apply_fp8_autowrap(model, None),
    ]
    for call in calls:
        for library in (ours, hf):
            with pytest.raises(ImportError, match="requires transformer_engine"):
                call(library)
