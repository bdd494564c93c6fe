"""``acc_fsdp``'s FSDP2 wrapping against HF accelerate's ``fsdp2_apply_ac`` + ``fsdp2_prepare_model``, 2 CPU processes.

Per variant the same model is prepared twice: by :class:`~lightning_accel.strategies.fsdp_core.FSDPFamily` (what
``acc_fsdp`` and ``acc_parallel`` run) and by HF accelerate 1.15's functions with its own plugin. Each rank records
which submodules are FSDP2 units (and whether they reshard after forward), the class of every submodule (checkpoint
and offload wrappers), each parameter's placement, local shape, dtype and device, and the losses and weights after
three AdamW steps, into ``{variant}_rank{r}.pt`` for ``tests/test_fsdp2_apply.py``.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel import utils as ours
from lightning_accel.state import PartialState
from lightning_accel.strategies.fsdp_core import FSDPFamily
from tests.scripts.fsdp_utils_parity import Net, full_weights, sharding_layout, stand_in

warnings.filterwarnings("ignore")

BLOCKS = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}
VARIANTS: dict[str, dict[str, Any]] = {
    "checkpointing": {**BLOCKS, "activation_checkpointing": True},
    "checkpointing_offload": {**BLOCKS, "activation_checkpointing": True, "activation_checkpointing_offload": True},
    "ram_efficient": {**BLOCKS, "cpu_ram_efficient_loading": True},
    "size_based": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 60},
    "tied": {**BLOCKS},
    "no_reshard": {**BLOCKS, "reshard_after_forward": False},
    "ignored": {**BLOCKS, "ignored_modules": "final_norm"},
    "bf16_policy": {
        **BLOCKS,
        "mixed_precision_policy": {
            "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32,
            "output_dtype": torch.float32,
        },
    },
}


class TiedNet(Net):
    """``Net`` whose head shares the input embedding's weight (a tied language-model head)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


class SequentialNet(Net):
    """``Net`` with its blocks in an ``nn.Sequential``: HF's size policy picks a ``ModuleList``, which FSDP2 refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*self.blocks)


MODELS: dict[str, type[Net]] = {"tied": TiedNet, "size_based": SequentialNet}


def model_for(variant: str) -> nn.Module:
    torch.manual_seed(0 if dist.get_rank() == 0 else 5)  # other ranks differ: efficient loading broadcasts rank 0's
    return MODELS.get(variant, Net)()


def describe(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    layout = sharding_layout(model)
    layout["classes"] = {name: type(m).__name__ for name, m in model.named_modules()}
    layout["params"] = {
        name: (
            tuple(str(p) for p in param.placements) if isinstance(param, DTensor) else None,
            tuple(param.to_local().shape if isinstance(param, DTensor) else param.shape),
            str(param.dtype),
            str(param.device),
        )
        for name, param in model.named_parameters()
    }
    return layout


def train(model: nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        ids = torch.randint(0, 16, (4, 3), generator=g)
        loss = model(ids).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def prepare_ours(variant: str) -> nn.Module:
    plugin = ours.FullyShardedDataParallelPlugin(fsdp_version=2, **VARIANTS[variant])
    return FSDPFamily(plugin).wrap(model_for(variant), torch.device("cpu"), dist.get_world_size())


def prepare_hf(variant: str) -> nn.Module:
    from accelerate.utils import FullyShardedDataParallelPlugin as HFPlugin
    from accelerate.utils import fsdp_utils as hf_fsdp

    # HF's plugin exports FSDP_CPU_RAM_EFFICIENT_LOADING and later plugins read it back: say False where not asked.
    fields = {"cpu_ram_efficient_loading": False, **VARIANTS[variant]}
    plugin = HFPlugin(fsdp_version=2, **fields)
    accelerator = stand_in(2, plugin)
    model = model_for(variant)
    if plugin.activation_checkpointing:
        model = hf_fsdp.fsdp2_apply_ac(accelerator, model)
    return hf_fsdp.fsdp2_prepare_model(accelerator, model)


def run(variant: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for label, prepare in (("ours", prepare_ours), ("hf", prepare_hf)):
        model = prepare(variant)
        layout = describe(model)
        layout["start"] = full_weights(model)
        layout["losses"] = train(model)
        layout["end"] = full_weights(model)
        result[label] = layout
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    PartialState(cpu=True)
    from accelerate import PartialState as HFPartialState

    HFPartialState(cpu=True)
    for variant in VARIANTS:
        torch.save(run(variant), args.out / f"{variant}_rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
