"""``acc_megatron_lm`` sequence parallelism on CPU processes (gloo), against tensor parallelism alone.

One 2-process run of ``tests/scripts/megatron_sequence.py``: ``tp_degree=2`` with ``sequence_parallelism=True``
(Fabric, Trainer and the ``Accelerator`` shim) trains to the losses and weights of ``tp_degree=2`` without it,
clipping by the global norm each step; the control run without the layer-norm gradient sum across tensor-parallel
ranks does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import load_rank_results, needs_megatron, torchrun_each

ATOL = 1e-5
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchrun_each(tmp_path_factory.mktemp("megatron_sequence"), "megatron_sequence.py", {2: 300})


@pytest.fixture(scope="module")
def runs(runs_dir: Path) -> Results:
    return load_rank_results(runs_dir)


def _max_weight_difference(result: dict[str, Any], reference: dict[str, Any]) -> float:
    assert result["weights"].keys() == reference["weights"].keys()
    return max(float((result["weights"][name] - ref).abs().max()) for name, ref in reference["weights"].items())


@pytest.mark.launch
@needs_megatron
@pytest.mark.parametrize("variant", ["fabric_tp2_sp", "trainer_tp2_sp", "accelerator_tp2_sp"])
def test_sequence_parallelism_trains_as_tensor_parallelism_alone(runs: Results, variant: str) -> None:
    for result, reference in zip(runs[variant], runs["fabric_tp2"], strict=True):
        assert result["tp"] == reference["tp"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
        assert _max_weight_difference(result, reference) < ATOL


@pytest.mark.launch
@needs_megatron
def test_without_the_layer_norm_gradient_sum_the_weights_drift(runs: Results) -> None:
    for result, reference in zip(runs["fabric_tp2_sp_unsummed"], runs["fabric_tp2"], strict=True):
        assert _max_weight_difference(result, reference) > 1e-3
