"""megatron-core's distributed optimizer on one CUDA device (NCCL), against torch's AdamW: run under torchrun.

What ``acc_megatron_lm`` refuses today (``use_distributed_optimizer=True``: on CPU megatron's
``DistributedDataParallel`` allocates its gradient buffers on CUDA and its optimizer takes CUDA tensors only). This
probe shows whether megatron-core 0.16.1 runs it on a GPU, the evidence a future change that lifts the refusal
needs: ``megatron_parity.py``'s model and batches, trained for a few steps with megatron's ``DistributedDataParallel``
and ``get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True))`` (Adam, no weight decay, no clipping),
and the same model with ``torch.optim.AdamW`` (weight decay 0). Saves ``distributed_optimizer_rank0.pt`` and
``torch_adamw_rank0.pt``: the losses and the weights.
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_accel.utils import MegatronLMPlugin
from tests.scripts.megatron_parity import COMMON, GLOBAL_BATCH, STEPS, build, dataset, loss_of

LR = 1e-2


def batches() -> list[Any]:
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH)
    return [[tensor.cuda() for tensor in batch] for batch in list(loader)[:STEPS]]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().float().cpu().clone() for name, param in model.named_parameters()}


def run_distributed_optimizer(model: torch.nn.Module) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=True, bf16=False
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    losses = []
    for batch in batches():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = loss_of(ddp, batch)
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "weights": weights(model), "optimizer": type(optimizer).__name__}


def run_torch_adamw(model: torch.nn.Module) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "weights": weights(model)}


def main() -> None:
    from megatron.core import parallel_state, tensor_parallel

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert int(os.environ["WORLD_SIZE"]) == 1
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    plugin = MegatronLMPlugin(**COMMON, gradient_clipping=0)
    model = build(plugin, cpu_attention=False).cuda()
    reference = copy.deepcopy(model)
    torch.save(run_distributed_optimizer(model), args.out / "distributed_optimizer_rank0.pt")
    torch.save(run_torch_adamw(reference), args.out / "torch_adamw_rank0.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
