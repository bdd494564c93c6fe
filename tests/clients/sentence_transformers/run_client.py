"""The sentence-transformers client: ``SentenceTransformerTrainer`` with MultipleNegativesRankingLoss and an evaluator.

``st_script.py`` (a tiny random BERT with mean pooling, saved locally, and seeded sentence pairs) runs once per side
at 1 and 2 processes; "ours" is the same program with ``accelerate`` resolved to lightning_accel. Each scenario
compares the final weights, every logged loss and the optimizer steps, and the embedding-similarity evaluator's
metrics during and after training, with HF accelerate's run, bit for bit.

Usage: ``python tests/clients/sentence_transformers/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.clients.harness import Check, Client, Outcomes, Run, Scenario, load_result, main, same_training

HERE = Path(__file__).resolve().parent


def same_training_and_evaluation(run: str) -> Check:
    training = same_training(run)

    def check(outcomes: Outcomes, work: Path) -> tuple[bool, str]:
        ok, detail = training(outcomes, work)
        ours, hf = load_result(work, "ours", run), load_result(work, "hf", run)
        same = repr(ours["evaluations"]) == repr(hf["evaluations"])  # repr: equal NaNs compare equal too
        same = same and repr(ours["final_evaluation"]) == repr(hf["final_evaluation"])
        spearman = ours["final_evaluation"].get("pairs_spearman_cosine")
        return ok and same, f"{detail}; evaluator {'same' if same else 'DIFFERENT'} (spearman {spearman:.4g})"

    return check


RUNS = [Run(f"mnrl_{n}", ("--out", "{out}"), processes=n) for n in (1, 2)]
SCENARIOS = [
    Scenario("sentence_transformers::mnrl_evaluator_1_process", ("mnrl_1",), same_training_and_evaluation("mnrl_1")),
    Scenario("sentence_transformers::mnrl_evaluator_2_processes", ("mnrl_2",), same_training_and_evaluation("mnrl_2")),
]
CLIENT = Client("sentence_transformers", HERE / "st_script.py", RUNS, SCENARIOS, retry_reference=True)

if __name__ == "__main__":
    sys.exit(main(CLIENT, __doc__.splitlines()[0]))
