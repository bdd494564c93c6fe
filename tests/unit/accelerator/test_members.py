"""The Accelerator members and module names added for Accelerate's API, one process, side by side with HF accelerate."""

from __future__ import annotations

import warnings
from typing import Any

import accelerate
import accelerate.local_sgd
import accelerate.optimizer
import accelerate.state
import pytest
import torch
from torch import nn

import lightning_accel
import lightning_accel.local_sgd
import lightning_accel.optimizer
import lightning_accel.state
from lightning_accel.inference import prepare_pippy
from lightning_accel.local_sgd import LocalSGD
from tests.helpers import reset_accelerator_states

MEMBERS = (
    "scaler",
    "native_amp",
    "is_fsdp2",
    "is_composable_parallelism_enabled",
    "multi_device",
    "deepspeed_plugin",
    "parallelism_config",
    "torch_device_mesh",
    "should_save_model",
    "has_fp8_handler",
    "fp8_enabled",
    "delayed_fp8_autocast",
    "has_lomo_optimizer",
    "flag_tensor",
    "fp8_recipe_handler",
    "ao_recipe_handler",
    "te_recipe_handler",
    "msamp_recipe_handler",
)


def _both(**kwargs: Any) -> tuple[Any, Any]:
    """HF accelerate's and lightning_accel's Accelerator, built with the same arguments (handlers per library)."""
    handlers = kwargs.pop("handlers", lambda module: [])
    hf = accelerate.Accelerator(cpu=True, kwargs_handlers=handlers(accelerate.utils), **kwargs)
    ours = lightning_accel.Accelerator(cpu=True, kwargs_handlers=handlers(lightning_accel.utils), **kwargs)
    return hf, ours


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_members_answer_as_hf(mixed_precision: str) -> None:
    def handlers(utils: Any) -> list[Any]:
        return [
            utils.DistributedDataParallelKwargs(bucket_cap_mb=5),
            utils.GradScalerKwargs(init_scale=8.0),
            utils.InitProcessGroupKwargs(),
            utils.ProfileKwargs(record_shapes=True),
        ]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU: both warn (or log) that it trains in fp32
        hf, ours = _both(mixed_precision=mixed_precision, handlers=handlers)
    for name in MEMBERS:
        assert getattr(ours, name) == getattr(hf, name), name
    assert str(ours.fp8_backend.value) == str(hf.fp8_backend.value) == "NO"
    for name in ("ddp_handler", "scaler_handler", "init_handler", "profile_handler"):
        assert getattr(ours, name).to_kwargs() == getattr(hf, name).to_kwargs(), name
    for rank in ("tensor_parallel_rank", "data_parallel_rank", "data_parallel_shard_rank"):
        for accelerator, error in ((hf, RuntimeError), (ours, RuntimeError)):
            with pytest.raises(error, match="not configured"):
                getattr(accelerator, rank)
    for rank in ("context_parallel_rank", "pipeline_parallel_rank"):
        for accelerator in (hf, ours):
            with pytest.raises(NotImplementedError, match="not supported in Accelerate"):
                getattr(accelerator, rank)


def test_fp8_recipe_needs_fp8_precision_as_in_hf() -> None:
    for module in (accelerate, lightning_accel):
        reset_accelerator_states()
        with pytest.raises(ValueError, match="mixed_precision='fp8'"):
            module.Accelerator(cpu=True, kwargs_handlers=[module.utils.AORecipeKwargs()])


def test_maybe_context_parallel_is_a_no_op_without_cp() -> None:
    _, ours = _both()
    warns = pytest.warns(UserWarning, match="Context parallel training is not enabled")
    with warns, ours.maybe_context_parallel(buffers=[torch.ones(2, 4)], buffer_seq_dims=[1]):
        value = 1
    assert value == 1


def test_on_main_process_with_and_without_function() -> None:
    hf, ours = _both()
    for accelerator in (hf, ours):
        assert accelerator.on_main_process(lambda x: x + 1)(1) == 2
        assert accelerator.on_local_main_process(lambda x: x * 3)(2) == 6

    class Subclass(lightning_accel.Accelerator):
        @lightning_accel.Accelerator.on_main_process  # type: ignore[arg-type]  # the class-level form
        def double(self, x: int) -> int:
            return 2 * x

    assert Subclass(cpu=True).double(4) == 8
    with pytest.raises(ValueError, match="must be called with a function"):
        ours.on_main_process()
    with pytest.raises(ValueError, match="needs the function"):
        lightning_accel.state.PartialState().on_main_process()


def test_prepare_model_evaluation_mode_and_prepare_optimizer_placement() -> None:
    hf, ours = _both(mixed_precision="bf16")
    x = torch.randn(3, 4)
    outputs = []
    for accelerator in (hf, ours):
        torch.manual_seed(0)
        model = accelerator.prepare_model(nn.Linear(4, 2), evaluation_mode=True)
        assert not isinstance(accelerator.unwrap_model(model), nn.parallel.DistributedDataParallel)
        optimizer = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=True)
        assert optimizer.param_groups[0]["lr"] == 0.1
        outputs.append(model(x))
    # Both run the forward under bf16 autocast and cast the outputs back to fp32.
    assert outputs[0].dtype == outputs[1].dtype == torch.float32
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def _scaled_step_skipped(module: Any) -> list[bool]:
    """An optimizer built directly with a GradScaler: an inf gradient skips the step, a finite one does not."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    optimizer = module.optimizer.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), True, scaler)
    skipped = []
    for factor in (float("inf"), 1.0):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum() * factor).backward()
        optimizer.step()
        skipped.append(optimizer.step_was_skipped)
    return skipped


def test_accelerated_optimizer_takes_hf_positional_arguments() -> None:
    _both()  # HF's AcceleratedOptimizer reads the state an Accelerator filled in
    assert _scaled_step_skipped(lightning_accel) == _scaled_step_skipped(accelerate) == [True, False]
    state = {"a": [torch.ones(1), (torch.zeros(2),)], "b": 3}
    for module in (accelerate.optimizer, lightning_accel.optimizer):
        moved = module.move_to_device(state, "cpu")
        assert moved["b"] == 3 and isinstance(moved["a"][1], tuple)
        holder = type("Holder", (), {})()
        patched = module.patch_optimizer_step(holder, lambda: "stepped")
        assert patched() == "stepped" and holder._accelerate_step_called is True


def test_accelerator_state_takes_hf_arguments() -> None:
    config = lightning_accel.ParallelismConfig()
    state = lightning_accel.state.AcceleratorState(mixed_precision="BF16", parallelism_config=config)
    assert state.mixed_precision == "bf16" and state.parallelism_config is config and state.deepspeed_plugin is None
    assert lightning_accel.state.is_initialized() and not state.is_fsdp2
    with pytest.raises(ValueError, match="cannot become 'fp16'"):
        lightning_accel.state.AcceleratorState(mixed_precision="fp16")
    assert lightning_accel.state.do_nothing(1, a=2) is accelerate.state.do_nothing(1, a=2) is None  # type: ignore[func-returns-value]
    lightning_accel.state.reset_state()
    assert lightning_accel.state.is_initialized() is accelerate.state.is_initialized() is False
    assert lightning_accel.state.PartialState().default_device == accelerate.state.PartialState().default_device


def test_lomo_backward_updates_as_hf() -> None:
    lomo_optim = pytest.importorskip("lomo_optim")
    results = []
    for module in (accelerate, lightning_accel):
        reset_accelerator_states()
        accelerator = module.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = accelerator.prepare(nn.Linear(4, 2))
        optimizer = accelerator.prepare(lomo_optim.Lomo(accelerator.unwrap_model(model), lr=0.1))
        assert accelerator.has_lomo_optimizer
        loss = model(torch.ones(3, 4)).pow(2).mean()
        accelerator.backward(loss, learning_rate=0.1)
        optimizer.step()  # a no-op for LOMO: the update happened in the backward pass
        results.append({k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()})
    for key, value in results[1].items():
        torch.testing.assert_close(value, results[0][key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="learning rate must be passed"):
        accelerator.lomo_backward(torch.tensor(1.0), None)  # type: ignore[arg-type,unused-ignore]


def test_local_sgd_on_one_process_is_off_as_hf() -> None:
    hf, ours = _both()
    for accelerator, module in ((hf, accelerate.local_sgd), (ours, lightning_accel.local_sgd)):
        model = accelerator.prepare(nn.Linear(2, 2))
        with module.LocalSGD(accelerator, model, local_sgd_steps=2) as local_sgd:
            local_sgd.step()
        assert local_sgd.enabled is False and local_sgd.num_steps == 1
    with pytest.raises(ValueError, match="positive integer"):
        LocalSGD(ours, model, local_sgd_steps=0)


def test_prepare_pippy_refuses_auto_split_on_cpu() -> None:
    lightning_accel.PartialState(cpu=True)
    with pytest.raises(ValueError, match=r"split_points=\[\.\.\.\]"):
        prepare_pippy(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), example_args=(torch.ones(1, 2),))
