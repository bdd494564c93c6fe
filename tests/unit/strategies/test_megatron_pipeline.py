"""``acc_megatron_lm`` pipeline parallelism through megatron-core's schedules, on CPU processes (gloo).

One 2-process run of ``tests/scripts/megatron_pipeline.py`` (pp_degree=2, num_micro_batches=2, megatron's 1F1B
schedule) against a 1-process reference in the same test module (pp_degree=1, a plain forward and backward per
batch): the losses the strategy reports, the weights after training, the stage files written by ``fabric.save`` and
an exact resume from them, Fabric and Trainer alike. Then the ``Accelerator`` shim with Accelerate's Megatron loop
(``tests/scripts/megatron_pipeline_accelerator.py``: ``loss = model(**batch)`` runs the step) at pp_degree=2 against the
same reference, its ``save_state`` folder (one model and one optimizer file per stage), and an exact resume in a
fresh launch driven by an Accelerate config file (``megatron_lm_pp_degree: 2``). Last, sequence parallelism inside
the pipeline (``tests/scripts/megatron_pipeline_sequence.py``: tp_degree=2, pp_degree=2, 4 processes) against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel._accelerator.megatron import GPTTrainStep, pipeline_batch
from lightning_accel.strategies.megatron_pipeline import split_micro_batches
from tests.helpers import (
    ACCELERATE_CONFIGS,
    SCRIPTS,
    free_port,
    load_rank_results,
    needs_megatron,
    run_python,
    torchrun,
    torchrun_each,
)

ATOL = 1e-5
Results = dict[str, list[dict[str, Any]]]


def test_split_micro_batches_cuts_every_tensor_alike() -> None:
    ids, labels = torch.arange(8).reshape(4, 2), torch.arange(8, 16).reshape(4, 2)
    parts = split_micro_batches([ids, labels], 2)
    assert [[t.tolist() for t in part] for part in parts] == [
        [[[0, 1], [2, 3]], [[8, 9], [10, 11]]],
        [[[4, 5], [6, 7]], [[12, 13], [14, 15]]],
    ]
    with pytest.raises(ValueError, match=r"4 samples cannot be cut into MegatronLMPlugin\(num_micro_batches=3\)"):
        split_micro_batches([ids], 3)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchrun_each(tmp_path_factory.mktemp("megatron_pipeline"), "megatron_pipeline.py", {1: 240, 2: 300})


@pytest.fixture(scope="module")
def runs(runs_dir: Path) -> Results:
    return load_rank_results(runs_dir)


def _assert_weights_match(result: dict[str, Any], reference: dict[str, Any]) -> None:
    assert result["weights"], "a stage holds parameters"
    for name, weight in result["weights"].items():
        torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.launch
@needs_megatron
@pytest.mark.parametrize("variant", ["fabric_pp2", "trainer_pp2"])
def test_pp2_with_two_micro_batches_trains_as_pp1(runs: Results, variant: str) -> None:
    reference = runs["pp1"][0]
    first, last = runs[variant]
    assert (first["stage"], last["stage"]) == ((0, 2), (1, 2))
    # The loss is reported on the last stage (mean over micro-batches), 0.0 on the others, as Accelerate's engine.
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    assert first["losses"] == [0.0] * len(reference["losses"])
    # The two stages hold disjoint parts of the model, together all of it, each trained as the whole model is.
    assert not first["weights"].keys() & last["weights"].keys()
    assert first["weights"].keys() | last["weights"].keys() == reference["weights"].keys()
    assert any(".layers.0." in name for name in first["weights"]) and "output_layer.weight" in last["weights"]
    assert any(".layers.1." in name for name in last["weights"])
    for result in (first, last):
        _assert_weights_match(result, reference)


@pytest.mark.launch
@needs_megatron
def test_each_stage_saves_its_own_file_and_resumes_exactly(runs: Results, runs_dir: Path) -> None:
    stages = [torch.load(runs_dir / f"fabric_pp2_pp0{stage}.ckpt", weights_only=True) for stage in (0, 1)]
    assert not (runs_dir / "fabric_pp2.ckpt").exists()
    assert [state["step"] for state in stages] == [2, 2]
    assert "embedding.word_embeddings.weight" in stages[0]["model"] and "output_layer.weight" in stages[1]["model"]
    assert "output_layer.weight" not in stages[0]["model"]
    assert all(len(state["optimizer"]["state"]) > 0 for state in stages)  # momentum buffers of each stage
    for stage in (0, 1):
        full, resumed = runs["fabric_pp2"][stage], runs["fabric_pp2_resumed"][stage]
        assert resumed["step"] == 2
        assert resumed["losses"] == full["losses"][2:]  # bit for bit: weights and momentum restored
        for name, weight in full["weights"].items():
            assert torch.equal(resumed["weights"][name], weight), name


# --- the Accelerator shim: Accelerate's Megatron loop ---


def test_the_pipeline_engine_takes_accelerates_batch_forms() -> None:
    ids, labels, mask = torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)
    assert pipeline_batch((), {"input_ids": ids, "labels": labels}) == [ids, labels]
    assert pipeline_batch(({"labels": labels, "input_ids": ids, "loss_mask": mask},), {}) == [ids, labels, mask]
    assert pipeline_batch((ids, labels), {}) == [ids, labels]
    assert pipeline_batch(([ids, labels],), {}) == [ids, labels]
    with pytest.raises(TypeError, match=r"input_ids and labels.*got \['attention_mask', 'input_ids'\]"):
        pipeline_batch((), {"input_ids": ids, "attention_mask": mask})


def test_the_gpt_train_step_averages_over_the_loss_mask() -> None:
    losses = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    step = GPTTrainStep()
    assert float(step.loss(losses, [losses, losses])) == 3.0
    assert float(step.loss(losses, [losses, losses, torch.tensor([[1, 0], [1, 0]])])) == 2.0


@needs_megatron
def test_a_compiling_dynamo_plugin_is_refused() -> None:
    from lightning_accel.config import TorchDynamoPlugin
    from lightning_accel.strategies.megatron import FabricAcceleratedMegatronLMStrategy
    from lightning_accel.utils import MegatronLMPlugin

    plugin = MegatronLMPlugin(context_parallel_size=1)
    FabricAcceleratedMegatronLMStrategy(plugin, dynamo_plugin=TorchDynamoPlugin(backend="no"))  # what launch passes
    with pytest.raises(ValueError, match=r"backend='INDUCTOR'.*dynamo_backend='no'"):
        FabricAcceleratedMegatronLMStrategy(plugin, dynamo_plugin=TorchDynamoPlugin(backend="inductor"))


@pytest.fixture(scope="module")
def accelerator_runs(runs_dir: Path) -> Results:
    """The shim's full run (torchrun), then its resume in a fresh launch from the config file."""
    script = "megatron_pipeline_accelerator.py"
    torchrun(script, "--out", str(runs_dir), "--phase", "full", nproc=2, timeout=300)
    config = ACCELERATE_CONFIGS / "megatron_pp2_cpu.yaml"
    launch = ["-m", "lightning_accel.cli", "launch", "--config_file", str(config), "--main_process_port"]
    resume = ["--out", str(runs_dir), "--phase", "resume", "--plugin-from-config"]
    run_python([*launch, str(free_port()), str(SCRIPTS / script), *resume], timeout=300)
    return load_rank_results(runs_dir)


@pytest.mark.launch
@needs_megatron
def test_accelerator_pp2_runs_accelerates_megatron_loop_as_pp1(accelerator_runs: Results) -> None:
    reference = accelerator_runs["pp1"][0]
    first, last = accelerator_runs["accelerator_pp2"]
    assert (first["stage"], last["stage"]) == ((0, 2), (1, 2))
    # model(**batch) returned the step's loss on the last stage and 0.0 on the first, as Accelerate's MegatronEngine.
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    assert first["losses"] == [0.0] * len(reference["losses"])
    assert first["weights"].keys() | last["weights"].keys() == reference["weights"].keys()
    for result in (first, last):
        _assert_weights_match(result, reference)
        assert result["scheduler_steps"] == len(reference["losses"])  # the engine stepped it once per step
    assert first["eval_loss"] == 0.0 and last["eval_loss"] > 0.0  # model.eval(): the forward passes only


@pytest.mark.launch
@needs_megatron
def test_accelerator_save_state_writes_each_stage_and_resumes_exactly(
    accelerator_runs: Results, runs_dir: Path
) -> None:
    folder = runs_dir / "acc_state"
    names = {path.name for path in folder.iterdir()}
    stage_files = {f"{stem}_pp0{stage}.bin" for stem in ("pytorch_model", "optimizer") for stage in (0, 1)}
    assert stage_files <= names
    assert not names & {"pytorch_model.bin", "model.safetensors", "optimizer.bin"}
    assert {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"} <= names
    stages = [torch.load(folder / f"pytorch_model_pp0{stage}.bin", weights_only=True) for stage in (0, 1)]
    assert "embedding.word_embeddings.weight" in stages[0] and "output_layer.weight" in stages[1]
    assert "output_layer.weight" not in stages[0]
    for stage in (0, 1):
        full, resumed = accelerator_runs["accelerator_pp2"][stage], accelerator_runs["accelerator_pp2_resumed"][stage]
        assert resumed["losses"] == full["losses"][2:]  # bit for bit: weights, momentum and scheduler restored
        assert resumed["scheduler_steps"] == full["scheduler_steps"]
        assert resumed["eval_loss"] == full["eval_loss"]
        for name, weight in full["weights"].items():
            assert torch.equal(resumed["weights"][name], weight), name


# --- sequence parallelism inside the pipeline (4 processes) ---


@pytest.mark.launch
@needs_megatron
def test_sequence_parallelism_at_tp2_pp2_trains_as_pp1(runs_dir: Path) -> None:
    torchrun("megatron_pipeline_sequence.py", "--out", str(runs_dir), nproc=4, timeout=300)
    results = load_rank_results(runs_dir)
    reference, ranks = results["pp1"][0], results["tp2_pp2_sp"]
    assert [result["stage"] for result in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # tensor-parallel peers
    for result in ranks[2:]:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    assert ranks[0]["losses"] == [0.0] * len(reference["losses"])
    assert ranks[0]["weights"].keys() | ranks[2]["weights"].keys() == reference["weights"].keys()
    for result in ranks:  # the layer norms' gradients summed across tensor-parallel ranks, as without the pipeline
        _assert_weights_match(result, reference)
