"""Ray Train's recipes with the acc_* strategies and the Accelerator, on a local Ray cluster of 2 CPU workers (gloo).

One Ray session serves the module; each test starts a ``TorchTrainer`` of 2 workers running a function of
``tests/scripts/ray_loops.py`` and compares the weights its rank 0 wrote. A run that does not finish within
``RUN_TIMEOUT`` seconds fails its test (the Ray session is shut down, which ends its workers).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
ray_train = pytest.importorskip("ray.train")
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from tests.helpers import has_module  # noqa: E402
from tests.scripts import ray_loops  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs whose workers import this checkout; the environment is put back after it."""
    environment = dict(os.environ)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(scope="module")
def reference(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of each Trainer strategy (Ray's RayDDPStrategy first) and of the Accelerator loop.

    The Trainer runs share one ``TorchTrainer`` (one after the other in the same workers): starting one costs more
    than a run.
    """
    out = tmp_path_factory.mktemp("reference")
    strategies = ["ray_ddp", "acc_ddp", "acc_fsdp", *(["acc_deepspeed"] if has_module("deepspeed") else [])]
    _run(ray_loops.trainer_loop, {"strategies": strategies}, out)
    _run(ray_loops.accelerator_loop, {}, out)
    return out


def _run(loop: Callable[[Mapping[str, Any]], None], config: dict[str, Any], out: Path, failures: int = 0) -> None:
    """Run ``loop`` on 2 Ray Train workers with ``config`` (plus ``out``); fail after ``RUN_TIMEOUT`` seconds."""
    trainer = TorchTrainer(
        loop,
        train_loop_config={**config, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=loop.__name__, storage_path=str(out / "ray"), failure_config=FailureConfig(max_failures=failures)
        ),
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(trainer.fit)
        try:
            future.result(timeout=RUN_TIMEOUT)
        except concurrent.futures.TimeoutError:
            ray.shutdown()  # ends the workers, so that fit() returns and the pool can close
            pytest.fail(f"the Ray Train run of {loop.__name__} did not finish within {RUN_TIMEOUT} s")


def _ran(folder: Path, name: str) -> dict[str, str]:
    return json.loads((folder / f"{name}.json").read_text())


def _weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"{name}.pt", weights_only=True)


def _assert_same(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0.0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def test_trainer_recipe_acc_ddp_matches_ray_ddp_strategy(reference: Path) -> None:
    ray_ddp = _weights(reference, "trainer_ray_ddp")
    start = ray_loops.model().state_dict()
    assert (ray_ddp["0.weight"] - start["0.weight"]).abs().max() > 1e-2  # it trained
    _assert_same(_weights(reference, "trainer_acc_ddp"), ray_ddp)  # bit for bit
    assert _ran(reference, "trainer_ray_ddp") == {"strategy": "RayDDPStrategy", "model": "DistributedDataParallel"}
    assert _ran(reference, "trainer_acc_ddp") == {
        "strategy": "AcceleratedDDPStrategy",
        "model": "DistributedDataParallel",
    }


def test_trainer_recipe_acc_fsdp_matches_ray_ddp_strategy(reference: Path) -> None:
    # fp32 on 2 CPU workers: FSDP's reduce-scatter sums the same two gradients as DDP's all-reduce, bit for bit
    _assert_same(_weights(reference, "trainer_acc_fsdp"), _weights(reference, "trainer_ray_ddp"))
    assert _ran(reference, "trainer_acc_fsdp")["strategy"] == "AcceleratedFSDPStrategy"


def test_accelerator_loop_matches_one_process_on_the_whole_batch(reference: Path) -> None:
    # 2 workers of 4 samples a step average their gradients: one process on the 8 samples in order, as Accelerate
    # shards a loader (whole batches in turn).
    net = ray_loops.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = ray_loops.dataset().tensors
    for _ in range(ray_loops.EPOCHS):
        for batch in torch.arange(len(x)).split(2 * ray_loops.BATCH):
            torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
            optimizer.step()
            optimizer.zero_grad()
    _assert_same(_weights(reference, "accelerator"), net.state_dict(), atol=1e-6)


def test_accelerator_loop_resumes_a_killed_worker(reference: Path, tmp_path: Path) -> None:
    _run(ray_loops.accelerator_loop, {"kill_at_step": 6}, tmp_path, failures=1)  # mid epoch 1; epoch 0 reported
    assert (tmp_path / "killed").exists()
    _assert_same(_weights(tmp_path, "accelerator"), _weights(reference, "accelerator"))


def test_trainer_recipe_resumes_a_killed_worker(reference: Path, tmp_path: Path) -> None:
    _run(ray_loops.trainer_loop, {"strategies": ["acc_ddp"], "kill_at_step": 6}, tmp_path, failures=1)
    assert (tmp_path / "killed").exists()
    _assert_same(_weights(tmp_path, "trainer_acc_ddp"), _weights(reference, "trainer_acc_ddp"))


def test_trainer_recipe_acc_deepspeed_matches_acc_ddp(reference: Path) -> None:
    pytest.importorskip("deepspeed")
    # ZeRO stage 2 (DeepSpeedPlugin's default) in fp32 sums the same two gradients: bit for bit
    _assert_same(_weights(reference, "trainer_acc_deepspeed"), _weights(reference, "trainer_acc_ddp"))
    assert _ran(reference, "trainer_acc_deepspeed") == {
        "strategy": "AcceleratedDeepSpeedStrategy",
        "model": "DeepSpeedEngine",
    }
