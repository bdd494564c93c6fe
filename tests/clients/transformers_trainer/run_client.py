"""The transformers.Trainer client: the same Trainer script under HF accelerate and under lightning_accel.

``trainer_script.py`` (a tiny random BERT built from a config, seeded synthetic data, no downloads) runs once per
side for each run below; "ours" is the same unmodified program with ``accelerate`` resolved to lightning_accel
(``LIGHTNING_ACCEL_ALIAS=1``, see ``site/sitecustomize.py``). Each scenario compares what both sides wrote: final
weights, per-step losses, evaluation metrics and predictions, saved model files and checkpoint file names. Runs,
launching and the training comparison are the shared harness's (``tests/clients/harness.py``).

Usage: ``python tests/clients/transformers_trainer/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``
(see tests/clients/run.py and the stage's contract).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.clients.harness import (
    SIDES,
    Check,
    Client,
    Outcomes,
    Run,
    Scenario,
    load_result,
    main,
    max_diff,
    same_training,
)

HERE = Path(__file__).resolve().parent
NAME = "transformers_trainer"

ZERO2, ZERO3 = str(HERE / "zero2.json"), str(HERE / "zero3.json")
ACCUM_CLIP = ("--accum", "2", "--max-grad-norm", "0.5")
RUNS = [
    Run("single", ("--out", "{out}", "--eval", "--save-steps", "4")),
    Run("accum_clip", ("--out", "{out}", *ACCUM_CLIP)),
    Run("peft", ("--out", "{out}", "--peft")),
    Run("resume", ("--out", "{out}", "--resume", "{side}/single/trainer/checkpoint-4"), after="single"),
    Run("ddp2", ("--out", "{out}", *ACCUM_CLIP, "--eval"), processes=2),
    Run("fsdp2", ("--out", "{out}", *ACCUM_CLIP, "--eval", "--fsdp"), processes=2, sides=("ours",)),
    Run(
        "zero2", ("--out", "{out}", "--deepspeed", ZERO2, *ACCUM_CLIP, "--save-steps", "2", "--save-model"), processes=2
    ),
    Run(
        "zero2_resume",
        ("--out", "{out}", "--deepspeed", ZERO2, *ACCUM_CLIP, "--resume", "{side}/zero2/trainer/checkpoint-2"),
        2,
        after="zero2",
    ),
    Run(
        "zero3", ("--out", "{out}", "--deepspeed", ZERO3, *ACCUM_CLIP, "--save-steps", "2", "--save-model"), processes=2
    ),
    Run(
        "zero3_resume",
        ("--out", "{out}", "--deepspeed", ZERO3, *ACCUM_CLIP, "--resume", "{side}/zero3/trainer/checkpoint-2"),
        2,
        after="zero3",
    ),
]


def same_evaluation(run: str) -> Check:
    """Evaluation loss and the predictions (padded last batch gathered and trimmed) against HF's."""

    def check(_: Outcomes, work: Path) -> tuple[bool, str]:
        ours, hf = load_result(work, "ours", run), load_result(work, "hf", run)
        loss = (ours["metrics"]["eval_loss"], hf["metrics"]["eval_loss"])
        shapes = (tuple(ours["predictions"].shape), tuple(hf["predictions"].shape))
        same = shapes[0] == shapes[1] and torch.equal(ours["predictions"], hf["predictions"])
        same = same and torch.equal(ours["label_ids"], hf["label_ids"]) and loss[0] == loss[1]
        return same, f"eval_loss {loss[0]:.6g}/{loss[1]:.6g}, predictions {shapes[0]}/{shapes[1]}"

    return check


def same_files(run: str, checkpoint: str) -> Check:
    """Training as HF's, the saved model file equal, and the checkpoint folder with HF's file names."""
    training = same_training(run)

    def check(results: Outcomes, work: Path) -> tuple[bool, str]:
        from safetensors.torch import load_file

        ok, detail = training(results, work)
        saved = [load_file(work / side / run / "saved" / "model.safetensors") for side in SIDES]
        saved_diff = max_diff(saved[1], saved[0])
        names = [_names(work / side / run / "trainer" / checkpoint) for side in SIDES]
        missing = sorted(names[0] ^ names[1])
        ok = ok and saved_diff == 0 and not missing
        return ok, f"{detail}; saved model diff {saved_diff:.3g}; checkpoint files differing: {missing[:3] or 'none'}"

    return check


def _names(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


SCENARIOS = [
    Scenario(f"{NAME}::single_process", ("single",), same_training("single")),
    Scenario(f"{NAME}::accumulation_max_grad_norm", ("accum_clip",), same_training("accum_clip")),
    Scenario(f"{NAME}::eval_predict_padded_last_batch", ("single",), same_evaluation("single")),
    Scenario(f"{NAME}::resume_in_fresh_process", ("single", "resume"), same_training("resume")),
    Scenario(f"{NAME}::two_processes", ("ddp2",), same_training("ddp2")),
    Scenario(f"{NAME}::two_processes_eval_predict", ("ddp2",), same_evaluation("ddp2")),
    Scenario(f"{NAME}::peft_lora", ("peft",), same_training("peft")),
    Scenario(f"{NAME}::deepspeed_zero2_save", ("zero2",), same_files("zero2", "checkpoint-2")),
    Scenario(f"{NAME}::deepspeed_zero2_resume", ("zero2", "zero2_resume"), same_training("zero2_resume")),
    Scenario(f"{NAME}::deepspeed_zero3_save", ("zero3",), same_files("zero3", "checkpoint-2")),
    Scenario(f"{NAME}::deepspeed_zero3_resume", ("zero3", "zero3_resume"), same_training("zero3_resume")),
    Scenario(
        f"{NAME}::fsdp_full_shard_equals_own_ddp",
        ("ddp2", "fsdp2"),
        same_training("fsdp2", reference=("ours", "ddp2"), atol=1e-6),
        comparison="atol=1e-6",
        reference="lightning_accel's own DDP run (HF accelerate falls back to DDP on CPU)",
    ),
]


CLIENT = Client(NAME, HERE / "trainer_script.py", RUNS, SCENARIOS, retry_reference=True)

if __name__ == "__main__":
    sys.exit(main(CLIENT, __doc__.splitlines()[0]))
