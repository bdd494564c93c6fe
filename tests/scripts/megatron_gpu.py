"""``acc_megatron_lm`` on one CUDA device (NCCL): what the CPU runs cannot show. Run under ``torch.distributed.run``.

Variants, each trained like ``megatron_parity.py``'s ``tp1`` (same data, weights and steps), saved as
``{variant}_rank0.pt``: ``native`` (megatron-core's own ``DotProductAttention``), ``cpu_attention`` (the
:class:`CPUCoreAttention` the CPU runs use, here on CUDA), ``rope`` (rotary position embeddings), ``selective`` and
``full`` (``recompute_activations`` with either granularity).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import CLIP, COMMON, run_trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert int(os.environ["WORLD_SIZE"]) == 1
    plain = MegatronLMPlugin(**COMMON, gradient_clipping=CLIP)
    rope = MegatronLMPlugin(**{**COMMON, "use_rotary_position_embeddings": True}, gradient_clipping=CLIP)
    recompute = {"recompute_activations": True, "gradient_clipping": CLIP}
    variants = {
        "native": lambda: run_trainer(plain, 1, "cuda", cpu_attention=False),
        "cpu_attention": lambda: run_trainer(plain, 1, "cuda", cpu_attention=True),
        "rope": lambda: run_trainer(rope, 1, "cuda", cpu_attention=False),
        "selective": lambda: run_trainer(
            MegatronLMPlugin(**COMMON, recompute_granularity="selective", **recompute), 1, "cuda", False
        ),
        "full": lambda: run_trainer(
            MegatronLMPlugin(**COMMON, recompute_granularity="full", **recompute), 1, "cuda", False
        ),
    }
    for name, run in variants.items():
        torch.save(run(), args.out / f"{name}_rank0.pt")
        dist.barrier()


if __name__ == "__main__":
    main()
