"""What ``Accelerator.prepare`` returns is what Accelerate's is: the DeepSpeed engine, DDP's members, and clipping.

The 2-process half runs ``tests/scripts/accelerator_engine_ddp.py`` once: DDP with the prepared model's own
``no_sync()`` and clipping over reversed parameters against HF accelerate, ZeRO-2 through the returned engine against
plain PyTorch. The in-process tests compare ``clip_grad_norm_`` with HF accelerate and torch on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import load_rank_results, reset_accelerator_states, torchrun

Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp("accelerator_engine_ddp")
    torchrun("accelerator_engine_ddp.py", "--out", str(out), timeout=400)
    found = load_rank_results(out)
    assert {name: len(ranks) for name, ranks in found.items()} == {
        "hf_ddp": 2,
        "ours_ddp": 2,
        "ours_deepspeed": 2,
        "ours_sharded": 2,
        "plain_deepspeed": 1,
    }
    return found


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=atol, msg=key)


@pytest.mark.launch
def test_ddp_no_sync_on_the_prepared_model_gives_hf_accelerates_weights(results: Results) -> None:
    for ours, hf in zip(results["ours_ddp"], results["hf_ddp"], strict=True):
        assert ours["unsynced"] == hf["unsynced"] == [True] * 2  # no_sync really kept each rank's own gradients
        assert ours["module_is_user_model"] and hf["module_is_user_model"]
        assert ours["norms"] == hf["norms"]  # clipped over the parameters in reverse order, bit for bit
        _assert_same(ours["weights"], hf["weights"])


@pytest.mark.launch
def test_deepspeed_prepare_returns_the_engine(results: Results) -> None:
    for ours in results["ours_deepspeed"]:
        assert ours["is_engine"] and ours["optimizer_wrapper"] and ours["engine_wrapped"]
        assert ours["config_stage"] == 2
        assert ours["unwrapped_is_user_model"]


@pytest.mark.launch
def test_deepspeed_engine_trains_checkpoints_and_restores(results: Results) -> None:
    plain = results["plain_deepspeed"][0]
    for ours in results["ours_deepspeed"]:
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(plain["norms"]), rtol=0, atol=1e-6)
        assert ours["engine_norm"] == ours["norms"][-1]
        _assert_same(ours["weights"], plain["weights"], atol=1e-6)
        assert ours["moved"]  # the steps after the checkpoint changed the weights ...
        _assert_same(ours["after_load_checkpoint"], ours["weights"])  # ... engine.load_checkpoint restored them
        _assert_same(ours["after_load_state"], ours["weights"])  # ... and so did accelerator.load_state


@pytest.mark.launch
def test_clip_grad_norm_is_the_global_norm_under_fsdp1_and_fsdp2(results: Results) -> None:
    """FSDP1's parameters are flat local shards: its root module computes the norm (each rank got its own before)."""
    for norms in results["ours_sharded"]:
        assert norms["fsdp1"] == pytest.approx(norms["ddp"], abs=1e-6)
        assert norms["fsdp2"] == pytest.approx(norms["ddp"], abs=1e-6)
    assert results["ours_sharded"][0] == results["ours_sharded"][1]


def _clipped(accelerate: Any, reverse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    reset_accelerator_states()
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    accelerator = accelerate.Accelerator(cpu=True)
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    params = list(model.parameters())
    norm = accelerator.clip_grad_norm_(params[::-1] if reverse else params, 0.25)
    return norm, [p.grad.clone() for p in params]


@pytest.mark.parametrize("reverse", [False, True], ids=["in_order", "reversed"])
def test_clip_grad_norm_is_hf_accelerates_over_the_given_parameters(reverse: bool) -> None:
    import accelerate

    import lightning_accel

    ours, hf = _clipped(lightning_accel, reverse), _clipped(accelerate, reverse)
    reset_accelerator_states()
    assert torch.equal(ours[0], hf[0])
    for mine, theirs in zip(ours[1], hf[1], strict=True):
        assert torch.equal(mine, theirs)


def test_clip_grad_norm_refuses_a_negative_max_norm() -> None:
    from lightning_accel import Accelerator

    reset_accelerator_states()
    net = nn.Linear(2, 1)
    accelerator = Accelerator(cpu=True)
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    before = net.weight.grad.clone()
    with pytest.raises(ValueError, match=r"max_norm=-1\b.*must be >= 0"):
        accelerator.clip_grad_norm_(model.parameters(), max_norm=-1)
    assert torch.equal(net.weight.grad, before)  # nothing was flipped
    reset_accelerator_states()


def test_deepspeed_wrappers_are_importable_where_transformers_looks() -> None:
    from lightning_accel.optimizer import AcceleratedOptimizer
    from lightning_accel.scheduler import AcceleratedScheduler
    from lightning_accel.utils import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper
    from lightning_accel.utils.deepspeed import DeepSpeedSchedulerWrapper as FromModule

    assert issubclass(DeepSpeedOptimizerWrapper, AcceleratedOptimizer)
    assert issubclass(DeepSpeedSchedulerWrapper, AcceleratedScheduler)
    assert FromModule is DeepSpeedSchedulerWrapper
    net = nn.Linear(2, 1)
    wrapper = DeepSpeedOptimizerWrapper(torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.ones(1, 2)).sum().backward()
    wrapper.step()  # the engine steps inside accelerator.backward: the wrapper's step and zero_grad do nothing
    wrapper.zero_grad()
    assert net.weight.grad is not None and not wrapper.step_was_skipped


def test_accelerator_has_accelerates_deepspeed_members() -> None:
    from lightning_accel import Accelerator

    reset_accelerator_states()
    accelerator = Accelerator(cpu=True)
    loader = [1, 2]
    assert accelerator.deepspeed_engine_wrapped is None  # no engine prepared
    assert accelerator.deepspeed_ulysses_dl_adapter(loader, nn.Linear(1, 1)) is loader  # sp_size 1: unchanged
    reset_accelerator_states()
