"""The TRL client: TRL's ``SFTTrainer`` (plain and with a PEFT LoRA adapter), ``DPOTrainer`` and ``GRPOTrainer``.

``trl_script.py`` (a tiny random Llama, a word-level tokenizer and seeded data built in code, no downloads) runs
once per side for each trainer, at 1 and 2 processes; "ours" is the same program with ``accelerate`` resolved to
lightning_accel. Each scenario compares the trainable weights, every logged loss and the optimizer steps with HF
accelerate's run, bit for bit. TRL's SFT and DPO tokenizing calls ``accelerate.logging``'s ``warning_once`` inside
``main_process_first``; GRPO samples completions with ``generate`` and scores them with a reward function in code.

Usage: ``python tests/clients/trl/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.clients.harness import Client, Run, Scenario, main, same_training

HERE = Path(__file__).resolve().parent
TRAINERS = ("sft", "sft_lora", "dpo", "grpo")
RUNS = [
    Run(f"{trainer}_{processes}", ("--trainer", trainer, "--out", "{out}"), processes=processes)
    for processes in (1, 2)
    for trainer in TRAINERS
]
SCENARIOS = [
    Scenario(f"trl::{trainer}_{processes}_process{'es' if processes > 1 else ''}", (run,), same_training(run))
    for processes in (1, 2)
    for trainer in TRAINERS
    if (run := f"{trainer}_{processes}")
]
CLIENT = Client("trl", HERE / "trl_script.py", RUNS, SCENARIOS, retry_reference=True)

if __name__ == "__main__":
    sys.exit(main(CLIENT, __doc__.splitlines()[0]))
