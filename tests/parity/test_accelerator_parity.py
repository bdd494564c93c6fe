"""Differential tests: the same script under HF accelerate and lightning_accel, on 1 and 2 CPU processes.

``tests/scripts/accelerator_parity.py`` runs both variants in one launch per process count; the tests compare what
each rank saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import SCRIPTS, accelerates_files, load_rank_results, run_python, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp(f"accelerator_parity_{request.param}")
    if request.param == 1:
        run_python([str(SCRIPTS / "accelerator_parity.py"), "--out", str(out)], timeout=240)
    else:
        torchrun("accelerator_parity.py", "--out", str(out), timeout=300)
    found = load_rank_results(out)
    assert {len(ranks) for ranks in found.values()} == {request.param}
    return found


def _pairs(results: Results) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return list(zip(results["ours"], results["hf"], strict=True))


def test_same_weights_and_losses(results: Results) -> None:
    for ours, hf in _pairs(results):
        assert ours["losses"] == hf["losses"]
        assert ours["weights"].keys() == hf["weights"].keys()
        for key, value in ours["weights"].items():
            torch.testing.assert_close(value, hf["weights"][key], rtol=0, atol=0, msg=key)


def test_same_process_layout(results: Results) -> None:
    for ours, hf in _pairs(results):
        assert ours["num_processes"] == hf["num_processes"] == len(results["ours"])
        assert ours["distributed_type"] == hf["distributed_type"]


def test_same_accumulation_windows_and_learning_rate(results: Results) -> None:
    for ours, hf in _pairs(results):
        assert ours["syncs"] == hf["syncs"]
        assert ours["syncs"][-1] is True  # the end of the data loader always synchronises
        assert ours["lr"] == hf["lr"]


def test_gather_for_metrics_drops_the_padding(results: Results) -> None:
    for ours, hf in _pairs(results):
        assert ours["eval_counts"] == hf["eval_counts"] == [11, 11]


def test_same_checkpoint_folders_and_files(results: Results) -> None:
    for ours, hf in _pairs(results):
        assert ours["folders"] == hf["folders"] == ["checkpoint_1", "checkpoint_2"]
        assert {folder: accelerates_files(names) for folder, names in ours["files"].items()} == hf["files"]
        expected = {"custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "scheduler.bin"}
        expected |= {f"random_states_{r}.pkl" for r in range(len(results["ours"]))}
        assert set(accelerates_files(ours["files"]["checkpoint_2"])) == expected
        assert ours["save_iteration"] == hf["save_iteration"] == 3


def test_loads_hf_accelerate_checkpoint(results: Results) -> None:
    for resumed, hf in zip(results["resume"], results["hf"], strict=True):
        from_hf = resumed["from_hf"]
        assert from_hf["lr"] == hf["lr"]
        assert from_hf["counter"] == 2
        for key, value in from_hf["weights"].items():
            torch.testing.assert_close(value, hf["weights"][key], rtol=0, atol=0, msg=key)


def test_load_state_restores_the_save_counter(results: Results) -> None:
    for resumed in results["resume"]:
        assert resumed["own"]["save_iteration"] == 3
        assert resumed["next_save"] == "checkpoint_3"


def test_hf_accelerate_loads_our_checkpoint(results: Results) -> None:
    for loaded, ours in zip(results["hf_loads_ours"], results["ours"], strict=True):
        assert loaded["lr"] == ours["lr"]
        assert loaded["counter"] == 2
        for key, value in loaded["weights"].items():
            torch.testing.assert_close(value, ours["weights"][key], rtol=0, atol=0, msg=key)


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for key, value in ours.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)


def test_stateful_loaders_are_saved_under_accelerates_names(results: Results) -> None:
    for record in results["stateful"]:
        ours, hf = record["ours"], record["hf"]
        assert accelerates_files(ours["epoch0"]["files"]) == hf["epoch0"]["files"]
        assert {"dl_state_dict.bin", "dl_state_dict_1.bin"} <= set(ours["epoch0"]["files"])


def test_stateful_mid_epoch_resume_continues_the_uninterrupted_run(results: Results) -> None:
    for record in results["stateful"]:
        ours, hf = record["ours"], record["hf"]
        assert ours["full"] == hf["full"]
        for label in ("epoch0", "epoch1", "from_hf"):
            resumed = ours[label]
            stop = len(ours["full"]) - len(resumed["rest"])
            assert stop == (ours["per_epoch"] + 2 if label == "epoch1" else 3)
            assert resumed["rest"] == ours["full"][stop:], label  # no batch skipped twice, none repeated
            _assert_same_weights(resumed["weights"], ours["weights"])
        assert hf["epoch0"]["rest"] == ours["epoch0"]["rest"]  # HF accelerate resumes epoch 0 the same way
