"""``fit``, ``validate``, ``test`` and ``predict`` in sequence on one Trainer, under every ``acc_*`` strategy.

One 2-process launch (``tests/scripts/entry_points.py``) runs each strategy through ``fit -> validate -> test ->
predict -> fit (continued) -> validate`` and ``validate -> test -> predict -> fit -> predict`` and compares every call
with Lightning's own ``ddp`` on the same seeds: weights after each ``fit`` (1e-5), the metrics ``validate``/``test``
return, and each rank's predictions. ``acc_no`` runs the same sequences in this process against Lightning's
single-device strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import load_rank_results, torchrun
from tests.scripts.entry_points import EVAL_FIRST, FIT_FIRST, STEPS, run_variant

Results = dict[str, list[dict[str, Any]]]
SEQUENCES = {"fit_first": FIT_FIRST, "eval_first": EVAL_FIRST}
STRATEGY_CLASS = {
    "acc_multi_cpu": "AcceleratedDDPStrategy",
    "acc_ddp": "AcceleratedDDPStrategy",
    "fsdp2": "AcceleratedFSDPStrategy",
    "fsdp1": "AcceleratedFSDPStrategy",
    "zero1": "AcceleratedDeepSpeedStrategy",
    "zero2": "AcceleratedDeepSpeedStrategy",
    "zero3": "AcceleratedDeepSpeedStrategy",
}
SHARDS_PARAMETERS = ("fsdp2", "fsdp1", "zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp("entry_points")
    torchrun("entry_points.py", "--out", str(out), timeout=240)
    return load_rank_results(out)


def assert_same_calls(ours: dict[str, Any], reference: dict[str, Any], where: str) -> None:
    assert ours["error"] is None, f"{where}: {ours['error']}"
    assert reference["error"] is None, f"{where} (reference): {reference['error']}"
    assert [c for c, _ in ours["calls"]] == [c for c, _ in reference["calls"]], where
    for index, ((call, value), (_, expected)) in enumerate(zip(ours["calls"], reference["calls"], strict=True)):
        at = f"{where}, call {index} ({call})"
        if call == "fit":
            assert value["global_step"] == expected["global_step"], at
            assert value["weights"].keys() == expected["weights"].keys(), at
            for key, weight in value["weights"].items():
                torch.testing.assert_close(weight, expected["weights"][key], rtol=0, atol=1e-5, msg=f"{at} {key}")
        elif call == "predict":
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-5, msg=at)
        else:
            assert [m.keys() for m in value] == [m.keys() for m in expected], at
            for metrics, expected_metrics in zip(value, expected, strict=True):
                for name, number in metrics.items():
                    assert number == pytest.approx(expected_metrics[name], abs=1e-5), f"{at} {name}"


@pytest.mark.parametrize("sequence", list(SEQUENCES))
@pytest.mark.parametrize("variant", list(STRATEGY_CLASS))
def test_every_call_gives_lightning_ddps_numbers(results: Results, variant: str, sequence: str) -> None:
    ours, reference = results[variant], results["ddp"]
    assert [r[sequence]["strategy_class"] for r in ours] == [STRATEGY_CLASS[variant]] * 2
    for rank, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert_same_calls(mine[sequence], theirs[sequence], f"{variant} {sequence} rank {rank}")


@pytest.mark.parametrize("variant", SHARDS_PARAMETERS)
def test_the_model_stays_sharded_across_entry_points(results: Results, variant: str) -> None:
    """Each call, the first one included, runs on (and leaves) the sharded model, never a gathered copy."""
    for rank, record in enumerate(results[variant]):
        for sequence, calls in SEQUENCES.items():
            fractions = record[sequence]["local_fractions"]
            assert len(fractions) == len(calls), (sequence, rank)
            assert max(fractions) < 0.6, (variant, sequence, rank, fractions)
    assert all(f == 1.0 for r in results["ddp"] for s in SEQUENCES for f in r[s]["local_fractions"])


@pytest.mark.parametrize("variant", ["ddp", *STRATEGY_CLASS])
def test_repeating_entry_points_leaves_no_hooks_behind(results: Results, variant: str) -> None:
    """A second ``fit`` (and the ``validate`` after it) leaves as many hooks on the module as the first one did."""
    for rank, record in enumerate(results[variant]):
        hooks = record["fit_first"]["hooks"]  # fit, validate, test, predict, fit, validate
        assert (hooks[4], hooks[5]) == (hooks[0], hooks[1]), (variant, rank, hooks)


def test_the_reference_calls_depend_on_the_training(results: Results) -> None:
    """Without this the comparisons above could not tell a stale model from a trained one."""
    for rank, record in enumerate(results["ddp"]):
        fit_first = dict(enumerate(record["fit_first"]["calls"]))
        (_, first_fit), (_, second_fit) = fit_first[0], fit_first[4]
        assert (first_fit["global_step"], second_fit["global_step"]) == (STEPS, 2 * STEPS)
        assert not torch.allclose(first_fit["weights"]["net.0.weight"], second_fit["weights"]["net.0.weight"])
        assert fit_first[1][1] != fit_first[5][1], rank  # validation after the first and the second fit
        eval_first = dict(enumerate(record["eval_first"]["calls"]))
        assert not torch.allclose(eval_first[2][1], eval_first[4][1]), rank  # predictions before and after fit
    rank0, rank1 = (r["fit_first"]["calls"][3][1] for r in results["ddp"])
    assert not torch.allclose(rank0, rank1)  # the ranks predict different halves of the data


@pytest.mark.usefixtures("undo_library_side_effects")  # seed_everything sets PL_GLOBAL_SEED
def test_acc_no_gives_the_single_device_numbers() -> None:
    ours, reference = run_variant("acc_no", devices=1), run_variant("auto", devices=1)
    for sequence in SEQUENCES:
        assert ours[sequence]["strategy_class"] == "AcceleratedSingleDeviceStrategy"
        assert reference[sequence]["strategy_class"] == "SingleDeviceStrategy"
        assert_same_calls(ours[sequence], reference[sequence], f"acc_no {sequence}")
