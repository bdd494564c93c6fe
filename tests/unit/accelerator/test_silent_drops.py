"""Settings that used to be dropped without a word now apply or raise.

``InitProcessGroupKwargs`` reaches DeepSpeed's process group, a user's ``GradScaler`` given through Lightning's
``MixedPrecision(..., scaler=...)`` is the one the plugin uses, and bf16 is refused on a GPU that only emulates it.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_accel import Accelerator
from lightning_accel.config import DeepSpeedPlugin, InitProcessGroupKwargs
from lightning_accel.precision import BF16Precision, FP16Precision, from_lightning
from lightning_accel.strategies.ddp import AcceleratedDDPStrategy
from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy
from lightning_accel.utils.modeling import cuda_bf16_problem
from tests.helpers import reset_accelerator_states


@pytest.mark.parametrize("lightning_cls", [MixedPrecision, FabricMixedPrecision])
def test_a_users_grad_scaler_is_kept(lightning_cls: type) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    lightning_plugin = lightning_cls("16-mixed", "cuda", scaler=scaler)
    assert lightning_plugin.scaler is scaler  # Lightning's own plugin keeps it: so must ours
    ours = from_lightning(lightning_plugin)
    assert isinstance(ours, FP16Precision)
    assert ours.scaler is scaler
    assert ours.state_dict() == scaler.state_dict()
    assert ours.state_dict()["scale"] == 8.0 and ours.state_dict()["growth_interval"] == 3


def test_a_strategy_given_lightnings_plugin_keeps_the_scaler() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    strategy = AcceleratedDDPStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=scaler)
    assert isinstance(strategy.precision_plugin, FP16Precision)
    assert strategy.precision_plugin.scaler is scaler


def test_scaler_conflicts_are_refused() -> None:
    from lightning_accel.config import GradScalerKwargs

    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="both a `scaler` and `scaler_kwargs`"):
        FP16Precision(scaler=scaler, scaler_kwargs=GradScalerKwargs(init_scale=2.0))
    with pytest.raises(ValueError, match="mode='true'"):
        FP16Precision(mode="true", scaler=scaler)
    with pytest.raises(TypeError, match=r"torch\.amp\.GradScaler"):
        FP16Precision(scaler="not a scaler")  # type: ignore[arg-type]


def test_bf16_is_refused_where_it_is_emulated() -> None:
    assert cuda_bf16_problem("NVIDIA A100", native=True) is None
    problem = cuda_bf16_problem("Tesla T4", native=False)
    assert problem is not None and "Tesla T4" in problem and "emulate" in problem and "fp16" in problem
    BF16Precision(device="cpu")  # CPU runs bf16 autocast natively
    if torch.cuda.is_available():
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        if native:
            BF16Precision(device="cuda")
        else:
            with pytest.raises(ValueError, match="emulate"):
                BF16Precision(device="cuda")


@pytest.mark.parametrize("cls", [AcceleratedDeepSpeedStrategy, FabricAcceleratedDeepSpeedStrategy])
def test_init_process_group_kwargs_reach_deepspeed(cls: type) -> None:
    handler = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=77))
    strategy = cls(DeepSpeedPlugin(zero_stage=2), init_kwargs=handler)
    # Lightning hands these two to deepspeed.init_distributed(backend, timeout=...).
    assert strategy._timeout == timedelta(seconds=77)
    assert strategy._process_group_backend == "gloo"
    untouched = cls(DeepSpeedPlugin(zero_stage=2), init_kwargs=InitProcessGroupKwargs())
    assert untouched._timeout == cls(DeepSpeedPlugin(zero_stage=2))._timeout
    with pytest.raises(ValueError, match="init_method"):
        cls(DeepSpeedPlugin(zero_stage=2), init_kwargs=InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="disagree"):
        cls(DeepSpeedPlugin(zero_stage=2), init_kwargs=handler, process_group_backend="mpi")


@pytest.mark.usefixtures("undo_library_side_effects", "process_wide_group")
def test_the_accelerator_passes_init_process_group_kwargs_to_deepspeed() -> None:
    pytest.importorskip("deepspeed")
    reset_accelerator_states()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    accelerator = Accelerator(
        cpu=True,
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config)),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=55))],
    )
    try:
        assert accelerator.fabric.strategy._timeout == timedelta(seconds=55)
        assert accelerator.fabric.strategy._process_group_backend == "gloo"
    finally:
        reset_accelerator_states()


def test_patching_a_private_lightning_member_checks_that_it_exists() -> None:
    import lightning
    import lightning.pytorch as pl

    from lightning_accel.callbacks._patching import InstancePatch
    from lightning_accel.lightning_compat import lightning_private

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    loop = trainer.fit_loop.epoch_loop
    original = loop._should_accumulate
    patch = InstancePatch(loop, "_should_accumulate", lambda: True)
    assert loop._should_accumulate() is True
    patch.restore()
    assert loop._should_accumulate == original
    with pytest.raises(RuntimeError, match=rf"_renamed_in_a_future_release.*lightning=={lightning.__version__}"):
        InstancePatch(loop, "_renamed_in_a_future_release", lambda: True)
    assert "_renamed_in_a_future_release" not in vars(loop)
    with pytest.raises(RuntimeError, match="_checkpoint_connectr"):
        lightning_private(trainer, "_checkpoint_connectr")
    assert lightning_private(trainer, "_checkpoint_connector") is trainer._checkpoint_connector
