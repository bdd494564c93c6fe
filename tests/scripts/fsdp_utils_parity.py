"""Accelerate's FSDP helpers, ours and HF accelerate's, on the same FSDP models over 2 CPU processes (gloo).

Per variant (FSDP2 and FSDP1; sharded, full and, for FSDP1, local state dicts; sharded also without DCP), a model is
wrapped and trained one AdamW step; ``save_fsdp_model``/``save_fsdp_optimizer`` of each library write into
``--out/{variant}/ours`` and ``.../hf``. A fresh model (other weights) then loads each library's files with the other
library's ``load_fsdp_model``/``load_fsdp_optimizer`` (ours reads HF's, HF reads ours) and trains one more step.
Then ``fsdp2_prepare_model`` (transformer-based, size-based and no wrapping; with ``cpu_ram_efficient_loading``),
``fsdp2_apply_ac``, ``model_has_dtensor`` and ``merge_fsdp_weights`` run on both sides. Each rank saves
``{name}_rank{r}.pt`` for ``tests/unit/utils/test_fsdp_utils.py``.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel import utils as ours
from lightning_accel.state import PartialState
from lightning_accel.utils import fsdp_utils as our_fsdp

warnings.filterwarnings("ignore")

VARIANTS: dict[str, tuple[int, str, bool]] = {  # FSDP version, state-dict type, use_dcp
    "fsdp2_sharded": (2, "SHARDED_STATE_DICT", True),
    "fsdp2_sharded_nodcp": (2, "SHARDED_STATE_DICT", False),
    "fsdp2_full": (2, "FULL_STATE_DICT", True),
    "fsdp1_sharded": (1, "SHARDED_STATE_DICT", True),
    "fsdp1_full": (1, "FULL_STATE_DICT", True),
    "fsdp1_local": (1, "LOCAL_STATE_DICT", True),
}
# HF accelerate's FSDP1 full-state-dict functions gather with CPU offload, which fails when the model is on CPU.
HF_FAILS_ON_CPU = {"fsdp1_full"}
# HF accelerate's FSDP1 sharded optimizer loading fails on a fresh optimizer (on its own checkpoints too); it cannot
# read FSDP1 local state dicts back (ShardedTensors with weights_only=True).
HF_CANNOT_LOAD_OPTIMIZER = {"fsdp1_sharded", "fsdp1_full", "fsdp1_local"}
HF_CANNOT_LOAD_MODEL = {"fsdp1_local"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.fc(x)))


class Net(nn.Module):
    """An embedding, repeated blocks, a final norm and a head: what Accelerate's FSDP2 grouping looks for."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.final_norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def stand_in(version: int, plugin: Any = None) -> SimpleNamespace:
    """What Accelerate's FSDP functions read from an accelerator."""
    state = PartialState()
    return SimpleNamespace(
        num_processes=state.num_processes,
        process_index=state.process_index,
        is_main_process=state.is_main_process,
        is_fsdp2=version == 2,
        wait_for_everyone=dist.barrier,
        state=SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision="no",
        device=torch.device("cpu"),
    )


def wrap(version: int, seed: int, local: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1's local state dicts hold the flat parameter, which loads back only without use_orig_params.
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=not local)


def same(mine: Any, theirs: Any) -> bool:
    """Whether two loaded states are equal, comparing sharded tensors by this process's shard."""
    if hasattr(mine, "local_tensor"):  # ShardedTensor
        return type(mine) is type(theirs) and torch.equal(mine.local_tensor(), theirs.local_tensor())
    if hasattr(mine, "to_local"):  # DTensor
        return type(mine) is type(theirs) and torch.equal(mine.to_local(), theirs.to_local())
    if isinstance(mine, dict):
        return isinstance(theirs, dict) and mine.keys() == theirs.keys() and all(same(mine[k], theirs[k]) for k in mine)
    if isinstance(mine, (list, tuple)):
        return len(mine) == len(theirs) and all(same(a, b) for a, b in zip(mine, theirs, strict=True))
    if isinstance(mine, torch.Tensor):
        return torch.equal(mine, theirs)
    return bool(mine == theirs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    ids = torch.randint(0, 16, (4, 3), generator=g)
    loss = model(ids).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered weights on every process (to compare models)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def plugins(version: int, state_dict_type: str, **fields: Any) -> tuple[Any, Any]:
    from accelerate.utils import FullyShardedDataParallelPlugin as HFPlugin

    return (
        ours.FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type, **fields),
        HFPlugin(fsdp_version=version, state_dict_type=state_dict_type, **fields),
    )


def checkpoint_round(name: str, out: Path) -> dict[str, Any]:
    from accelerate.utils import fsdp_utils as hf_fsdp

    version, kind, use_dcp = VARIANTS[name]
    our_plugin, hf_plugin = plugins(version, kind)
    accelerator = stand_in(version)
    root = out / name
    local = kind == "LOCAL_STATE_DICT"
    model = wrap(version, seed=0, local=local)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_step(model, optimizer, seed=1)
    result: dict[str, Any] = {"saved": full_weights(model)}
    our_fsdp.save_fsdp_model(our_plugin, accelerator, model, root / "ours", use_dcp=use_dcp)
    our_fsdp.save_fsdp_optimizer(our_plugin, accelerator, optimizer, model, root / "ours", use_dcp=use_dcp)
    hf_runs = name not in HF_FAILS_ON_CPU
    if hf_runs:
        hf_fsdp.save_fsdp_model(hf_plugin, accelerator, model, str(root / "hf"), use_dcp=use_dcp)
        hf_fsdp.save_fsdp_optimizer(hf_plugin, accelerator, optimizer, model, str(root / "hf"), use_dcp=use_dcp)
    train_step(model, optimizer, seed=2)
    result["continued"] = full_weights(model)
    dist.barrier()
    if hf_runs:  # per-process files can only be read back inside the process group (ShardedTensor, DTensor)
        rank_files = sorted(p.name for p in (root / "ours").glob(f"*_rank{dist.get_rank()}.bin"))
        result["rank_files"] = {
            name: same(
                torch.load(root / "ours" / name, weights_only=False), torch.load(root / "hf" / name, weights_only=False)
            )
            for name in rank_files
        }
    # Ours loads HF's files (or its own where HF cannot write here), HF loads ours.
    loads = {
        "ours_reads_hf" if hf_runs else "ours_reads_ours": (our_fsdp, our_plugin, root / ("hf" if hf_runs else "ours"))
    }
    if name not in HF_FAILS_ON_CPU | HF_CANNOT_LOAD_MODEL:
        loads["hf_reads_ours"] = (hf_fsdp, hf_plugin, root / "ours")
    for label, (library, plugin, source) in loads.items():
        fresh = wrap(version, seed=100, local=local)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
        train_step(fresh, fresh_optimizer, seed=7)  # an optimizer state to overwrite
        result[f"{label}_initial"] = full_weights(fresh)
        # FSDP1's local shards are ShardedTensors, which our weights-only load refuses: this folder is trusted.
        trusted = {"weights_only": False} if local and library is our_fsdp else {}
        library.load_fsdp_model(plugin, accelerator, fresh, str(source), use_dcp=use_dcp, **trusted)
        result[f"{label}_model"] = full_weights(fresh)
        if library is our_fsdp or name not in HF_CANNOT_LOAD_OPTIMIZER:
            library.load_fsdp_optimizer(plugin, accelerator, fresh_optimizer, fresh, str(source), use_dcp=use_dcp)
            train_step(fresh, fresh_optimizer, seed=2)
            result[f"{label}_continued"] = full_weights(fresh)
    dist.barrier()
    return result


def sharding_layout(model: nn.Module) -> dict[str, Any]:
    """Which modules are FSDP2 units (with their reshard setting), and this process's local shards."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    units = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            units[name] = None if group is None else group.post_forward_mesh_info is not None
    shards = {n: p.to_local().detach().clone() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return {"units": units, "shards": shards, "dtensor": ours.model_has_dtensor(model)}


def prepare_round(policy: str, efficient: bool, min_num_params: int = 300) -> dict[str, Any]:
    from accelerate.utils import fsdp_utils as hf_fsdp
    from accelerate.utils.other import model_has_dtensor as hf_model_has_dtensor

    fields: dict[str, Any] = {"auto_wrap_policy": policy, "cpu_ram_efficient_loading": efficient}
    if policy == "transformer_based_wrap":
        fields["transformer_cls_names_to_wrap"] = ["Block"]
    if policy == "size_based_wrap":
        fields["min_num_params"] = min_num_params
    our_plugin, hf_plugin = plugins(2, "SHARDED_STATE_DICT", **fields)
    result: dict[str, Any] = {}
    for label, library, plugin in (("ours", our_fsdp, our_plugin), ("hf", hf_fsdp, hf_plugin)):
        torch.manual_seed(0 if dist.get_rank() == 0 else 5)  # other ranks differ: efficient loading broadcasts rank 0's
        model = Net()
        try:
            prepared = library.fsdp2_prepare_model(stand_in(2, plugin), model)
        except ValueError as err:  # HF's size policy picks the ModuleList, which fully_shard refuses
            result[label] = {"error": str(err).splitlines()[0]}
            continue
        layout = sharding_layout(prepared)
        layout["hf_dtensor"] = hf_model_has_dtensor(prepared)
        layout["full"] = full_weights(prepared)
        result[label] = layout
    return result


def activation_checkpointing_round() -> dict[str, Any]:
    from accelerate.utils import fsdp_utils as hf_fsdp

    fields = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}
    our_plugin, hf_plugin = plugins(2, "SHARDED_STATE_DICT", activation_checkpointing=True, **fields)
    result = {}
    for label, library, plugin in (("ours", our_fsdp, our_plugin), ("hf", hf_fsdp, hf_plugin)):
        model = library.fsdp2_apply_ac(stand_in(2, plugin), Net())
        result[label] = sorted(type(m).__name__ + ":" + n for n, m in model.named_modules())
    return result


def merge_round(out: Path) -> dict[str, Any]:
    from accelerate.utils import merge_fsdp_weights as hf_merge

    source = out / "fsdp2_sharded" / "ours" / "pytorch_model_fsdp_0"
    our_fsdp.merge_fsdp_weights(source, out / "merged" / "ours")
    hf_merge(str(source), str(out / "merged" / "hf"))
    dist.barrier()
    return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    PartialState(cpu=True)  # ours joins the launch (gloo); HF's then joins the same process group
    from accelerate import PartialState as HFPartialState

    HFPartialState(cpu=True)
    rank = dist.get_rank()
    results: dict[str, Any] = {name: checkpoint_round(name, args.out) for name in VARIANTS}
    for policy in ("transformer_based_wrap", "size_based_wrap", "no_wrap"):
        for efficient in (False, True):
            results[f"prepare_{policy}_{efficient}"] = prepare_round(policy, efficient)
    results["prepare_size_based_wrap_60"] = prepare_round("size_based_wrap", False, min_num_params=60)
    results["apply_ac"] = activation_checkpointing_round()
    results["merge"] = merge_round(args.out)
    for name, result in results.items():
        torch.save(result, args.out / f"{name}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
