"""An Accelerator inside ``debug_launcher`` on 2 CPU processes, compared with HF accelerate's under its own launcher.

What Accelerate's test scripts (``test_sync``, ``test_ops``, ``test_script``) rely on: several forwards under
``no_sync`` then ``trigger_sync_in_backward`` for the last backward, ``end_training``/``destroy_process_group`` leaving
the launcher's process group alone, and ``prepare`` naming an ``AcceleratorState._reset_state()``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import reset_accelerator_states

LIBRARIES = ("accelerate", "lightning_accel")


def _worker(library: str, folder: str) -> None:
    package = importlib.import_module(library)
    state = importlib.import_module(f"{library}.state")
    torch.manual_seed(0)
    accelerator = package.Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    rank = accelerator.process_index
    inputs = torch.full((1, 2), float(rank + 1))
    with accelerator.no_sync(model):
        first = model(inputs).sum()
        second = model(3 * inputs).sum()
    accelerator.backward(first)
    local = [p.grad.clone() for p in model.parameters()]
    with accelerator.trigger_sync_in_backward(model):
        accelerator.backward(second)
    synced = [p.grad.clone() for p in model.parameters()]
    accelerator.end_training()
    group_kept = dist.is_initialized()
    state.PartialState().destroy_process_group()
    fork_launched = state.PartialState().fork_launched
    state.AcceleratorState._reset_state()
    try:
        accelerator.prepare(torch.nn.Linear(1, 1))
        error = "prepare did not raise"
    except AttributeError as err:
        error = str(err)
    result = {
        "local": local,
        "synced": synced,
        "group_kept": group_kept and dist.is_initialized(),
        "fork_launched": fork_launched,
        "error": error,
    }
    torch.save(result, Path(folder, f"{library}_rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("debug_launch")
    found = {}
    for library in LIBRARIES:
        reset_accelerator_states()
        importlib.import_module(library).debug_launcher(_worker, args=(library, str(folder)))
        found[library] = [torch.load(folder / f"{library}_rank{r}.pt", weights_only=False) for r in range(2)]
    reset_accelerator_states()
    return found


def test_trigger_sync_in_backward_syncs_only_the_last_backward(results: dict[str, list[dict[str, Any]]]) -> None:
    ours, hf = results["lightning_accel"], results["accelerate"]
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["local"], hf[rank]["local"])
        torch.testing.assert_close(ours[rank]["synced"], hf[rank]["synced"])
    # rank-local after the first backward, averaged over the ranks after the triggered one
    assert not torch.equal(ours[0]["local"][0], ours[1]["local"][0])
    torch.testing.assert_close(ours[0]["synced"], ours[1]["synced"])
    # weight grad: (x_r + 3 x_r) averaged over ranks, x_r = rank + 1
    torch.testing.assert_close(ours[0]["synced"][0], torch.full((1, 2), 6.0))


def test_destroying_the_group_leaves_the_launchers(results: dict[str, list[dict[str, Any]]]) -> None:
    for library in LIBRARIES:
        assert [(r["group_kept"], r["fork_launched"]) for r in results[library]] == [(True, True)] * 2, library


def test_prepare_after_reset_names_the_reset(results: dict[str, list[dict[str, Any]]]) -> None:
    for library in LIBRARIES:
        for rank in results[library]:
            assert "`AcceleratorState` object has no attribute" in rank["error"], library
            assert "This happens if `AcceleratorState._reset_state()`" in rank["error"], library
