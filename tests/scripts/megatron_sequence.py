"""``acc_megatron_lm`` sequence parallelism on 2 CPU processes (gloo): tp_degree=2 with and without it.

Run under ``torch.distributed.run`` with 2 processes. Every variant trains the GPT of ``megatron_parity`` for the
same steps on the same batches from the same weights, clipping by the global norm every step: ``fabric_tp2``
(Fabric, no sequence parallelism), and with ``sequence_parallelism=True`` ``fabric_tp2_sp``, ``trainer_tp2_sp`` and
``accelerator_tp2_sp`` (the shim). Each rank saves ``{variant}_rank{r}.pt``: the losses and the whole weights. The
control, ``fabric_tp2_sp_unsummed``, skips the strategy's sum of the layer-norm gradients across tensor-parallel
ranks, to show that the match depends on it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_accel.strategies.megatron import FabricAcceleratedMegatronLMStrategy
from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import CLIP, COMMON, run_accelerator, run_fabric, run_trainer

TP2 = MegatronLMPlugin(**COMMON, tp_degree=2, gradient_clipping=CLIP)
TP2_SP = MegatronLMPlugin(**COMMON, tp_degree=2, gradient_clipping=CLIP, sequence_parallelism=True)


def unsummed() -> FabricAcceleratedMegatronLMStrategy:
    """The strategy with its sum of sequence-parallel gradients left out (the control run)."""
    strategy = FabricAcceleratedMegatronLMStrategy(TP2_SP)
    strategy._megatron.reduce_sequence_parallel_gradients = lambda modules: None  # type: ignore[method-assign]
    return strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    variants = {
        "fabric_tp2": lambda: run_fabric(TP2, 2),
        "fabric_tp2_sp": lambda: run_fabric(TP2_SP, 2),
        "trainer_tp2_sp": lambda: run_trainer(TP2_SP, 2),
        "accelerator_tp2_sp": lambda: run_accelerator(TP2_SP),
        "fabric_tp2_sp_unsummed": lambda: run_fabric(TP2_SP, 2, strategy=unsummed()),
    }
    for name, run in variants.items():
        torch.save(run(), args.out / f"{name}_rank{rank}.pt")
        dist.barrier()


if __name__ == "__main__":
    main()
