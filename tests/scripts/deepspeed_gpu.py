"""One CUDA device: lightning_accel's DeepSpeed stages against Lightning's ``ddp``, and resuming from a checkpoint.

Runs in one process (no launcher); saves ``{variant}.pt`` with the losses and final weights for
``tests/unit/strategies/test_deepspeed.py::test_one_gpu_stages_match_ddp_and_resume``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tests.scripts import deepspeed_parity as parity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out: Path = parser.parse_args().out
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    parity.ACCELERATOR, parity.DEVICES = "gpu", 1
    results = {"ddp": parity.run_trainer("ddp")}
    for stage in (1, 2, 3):
        checkpoint = out / f"stage{stage}.ckpt"
        results[f"stage{stage}"] = parity.run_trainer(parity.plugin(stage), checkpoint=checkpoint)
        results[f"stage{stage}_resume"] = parity.run_trainer(parity.plugin(stage), resume=checkpoint)
    for name, result in results.items():
        weights = {k: v.cpu() for k, v in result["weights"].items()}
        torch.save({"losses": result["losses"], "weights": weights}, out / f"{name}.pt")


if __name__ == "__main__":
    main()
