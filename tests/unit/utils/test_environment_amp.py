"""patch_environment / clear_environment / purge_accelerate_environment and the amp helpers, against HF accelerate."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import accelerate.utils as hf
import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_accel.config import AutocastKwargs
from lightning_accel.enums import DistributedType
from lightning_accel.state import AcceleratorState
from lightning_accel.utils import (
    clear_environment,
    get_grad_scaler,
    get_mixed_precision_context_manager,
    patch_environment,
    purge_accelerate_environment,
)


def _environment_after(patch: Callable[..., AbstractContextManager[Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """Run one patch over a prepared environment; return (inside, after) restricted to the test's variables."""

    def ours() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("LA_TEST_")}

    os.environ["LA_TEST_KEPT"] = "old"
    os.environ["LA_TEST_OTHER"] = "untouched"
    try:
        with patch(la_test_kept=1, LA_TEST_NEW=2.5):
            inside = ours()
            os.environ["LA_TEST_ADDED_INSIDE"] = "x"
        return inside, ours()
    finally:
        for key in [k for k in os.environ if k.startswith("LA_TEST_")]:
            del os.environ[key]


def test_patch_environment_matches_accelerate() -> None:
    assert _environment_after(patch_environment) == _environment_after(hf.patch_environment)
    inside, after = _environment_after(patch_environment)
    assert inside == {"LA_TEST_KEPT": "1", "LA_TEST_NEW": "2.5", "LA_TEST_OTHER": "untouched"}
    assert after == {"LA_TEST_KEPT": "old", "LA_TEST_OTHER": "untouched", "LA_TEST_ADDED_INSIDE": "x"}


def test_clear_environment_empties_and_restores_everything() -> None:
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["LA_TEST_INSIDE"] = "1"
    assert dict(os.environ) == before


def _sets_variables() -> str:
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
    os.environ["ACCELERATE_LA_TEST_EXISTING"] = "changed"
    return "done"


def test_purge_accelerate_environment_on_a_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setenv("ACCELERATE_LA_TEST_EXISTING", "kept")
    assert purge_accelerate_environment(_sets_variables)() == "done"
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ
    assert os.environ["ACCELERATE_LA_TEST_EXISTING"] == "kept"


@pytest.mark.usefixtures("undo_library_side_effects")
def test_purge_accelerate_environment_on_a_class_and_its_subclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    @purge_accelerate_environment
    class Base:
        def test_a(self) -> str:
            return _sets_variables()

        def helper(self) -> str:
            return _sets_variables()

    class Child(Base):
        def test_b(self) -> str:
            return _sets_variables()

    for call in (Base().test_a, Child().test_a, Child().test_b):
        monkeypatch.setenv("ACCELERATE_LA_TEST_EXISTING", "kept")
        assert call() == "done"
        assert "ACCELERATE_MIXED_PRECISION" not in os.environ
        assert os.environ["ACCELERATE_LA_TEST_EXISTING"] == "kept"
    Base().helper()  # not a test method: left alone
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "fp16"


def _autocast_state(precision: str) -> None:
    state = AcceleratorState()
    state.mixed_precision = precision


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_mixed_precision_context_autocasts_like_accelerate(precision: str) -> None:
    _autocast_state(precision)
    layer = torch.nn.Linear(4, 4)
    with get_mixed_precision_context_manager(native_amp=True):
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    with get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=AutocastKwargs(enabled=False)):
        assert layer(torch.ones(2, 4)).dtype == torch.float32
    with get_mixed_precision_context_manager(native_amp=False):
        assert layer(torch.ones(2, 4)).dtype == torch.float32


def test_mixed_precision_context_refuses_fp16_on_cpu() -> None:
    _autocast_state("fp16")
    with pytest.raises(ValueError, match="bf16"):
        get_mixed_precision_context_manager(native_amp=True)


def test_grad_scaler_kind_and_arguments() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        plain = get_grad_scaler(init_scale=8.0)
        sharded = get_grad_scaler(DistributedType.FSDP, growth_interval=3)
        reference = hf.get_grad_scaler(init_scale=8.0)
    assert type(plain) is type(reference) is torch.amp.GradScaler
    assert plain.is_enabled() is reference.is_enabled() is False  # no CUDA here: torch disables it, as for Accelerate
    assert isinstance(sharded, ShardedGradScaler)
    with pytest.raises(TypeError, match="init_scal"):
        get_grad_scaler(init_scal=8.0)
