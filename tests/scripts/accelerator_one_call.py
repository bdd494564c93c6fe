"""Accelerate's canonical script on 2 CPU processes: ``prepare(model, optimizer, loader, scheduler)`` in one call.

The optimizer is built from the unsharded model, with two param groups that differ in ``lr``, ``weight_decay`` and
``betas``. The same training runs under HF accelerate's ``Accelerator(cpu=True)`` (MULTI_CPU, i.e. DDP: HF accelerate
cannot shard on CPU) and under lightning_accel, in one launch:

- ``--mode matrix`` (under ``torch.distributed.run``): lightning_accel with FSDP2, FSDP1 (``use_orig_params`` True and
  False), DeepSpeed ZeRO-1/2/3 (when deepspeed is installed), plain ``Fabric(strategy="acc_fsdp")`` with
  ``fabric.setup(model, optimizer)`` (against plain DDP) and torchao float8 training under FSDP2 (against DDP); then
  the one-call errors (a flat parameter split between param groups, a tensor that is not the model's, an optimizer
  that has stepped) and the error for an optimizer built before a separate ``prepare(model)``.
- ``--mode env`` (under ``lightning-accel launch --config_file ...``): lightning_accel's plain ``Accelerator()``, set up
  by the launcher's environment; HF accelerate's reference run does not see the launcher's FSDP variables.

Each rank writes ``one_call_rank{r}.pt`` into ``--out`` for ``tests/launch/test_accelerator_one_call.py`` and
``tests/launch/test_cli_launch_one_call.py``: per variant, the losses, the final learning rates, the full weights (main
process) and what the prepared optimizer holds; per error case, the message.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import reset_accelerator_states

WRAP: dict[str, Any] = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Linear"]}
# The environment `lightning-accel launch` sets from an FSDP config file, which HF accelerate's reference must not see.
_FSDP_ENV_PREFIXES = ("FSDP_", "ACCELERATE_USE_FSDP")


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def optimizer_for(model: nn.Sequential) -> torch.optim.Optimizer:
    """AdamW over the unsharded model: the first Linear in one group, the others in a second with other settings."""
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    return torch.optim.AdamW(
        [
            {"params": first, "lr": 0.02, "weight_decay": 0.1},
            {"params": rest, "lr": 0.01, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        ]
    )


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)


def fit(accelerator: Any) -> dict[str, Any]:
    """The canonical Accelerate loop; returns what the test compares."""
    model = net()
    optimizer = optimizer_for(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(), scheduler)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    return {
        "type": str(accelerator.distributed_type.value),
        "losses": losses,
        "lrs": scheduler.get_last_lr(),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "weights": weights,
        "fsdp_units": _fsdp_units(model),
        **_held_by_optimizer(accelerator.unwrap_model(model), optimizer.optimizer),
    }


def _fsdp_units(model: nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _held_by_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    held = [p for g in optimizer.param_groups for p in g["params"]]
    own = list(model.parameters())
    return {
        "held_are_model_params": all(any(p is q for q in own) for p in held),
        "held_dtensors": sum(isinstance(p, DTensor) for p in held),
        "held_count": len(held),
    }


def hf(fsdp_env_hidden: bool = False) -> dict[str, Any]:
    import accelerate

    reset_accelerator_states()
    with _hidden(_FSDP_ENV_PREFIXES) if fsdp_env_hidden else contextlib.nullcontext():
        accelerator = accelerate.Accelerator(cpu=True)
    return fit(accelerator)


def ours(**plugins: Any) -> dict[str, Any]:
    from lightning_accel import Accelerator

    reset_accelerator_states()
    return fit(Accelerator(cpu=True, **plugins))


def ours_from_env() -> dict[str, Any]:
    from lightning_accel import Accelerator

    reset_accelerator_states()
    accelerator = Accelerator()
    result = fit(accelerator)
    plugin = getattr(accelerator.fabric.strategy, "fsdp_plugin", None)
    fields = ("fsdp_version", "auto_wrap_policy", "state_dict_type", "use_orig_params")
    result["fsdp_plugin"] = None if plugin is None else {name: getattr(plugin, name) for name in fields}
    return result


def fabric_fsdp2() -> dict[str, Any]:
    """Plain Fabric: ``fabric.setup(model, optimizer)`` with an optimizer built before sharding."""
    from lightning.fabric import Fabric
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_accel.strategies.fsdp import FabricAcceleratedFSDPStrategy
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    strategy = FabricAcceleratedFSDPStrategy(FullyShardedDataParallelPlugin(fsdp_version=2, **WRAP))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = net()
    model, optimizer = fabric.setup(model, optimizer_for(model))
    data = fabric.setup_dataloaders(loader(), use_distributed_sampler=True)
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = get_model_state_dict(model._forward_module, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in full.items()}}


def fabric_fp8(fsdp2: bool) -> dict[str, Any]:
    """torchao float8 training (CPU gate lifted) with ``fabric.setup(model, optimizer)``, under FSDP2 or DDP.

    FSDP2's float8 all-gather wraps the converted weights in new parameters before sharding, so the optimizer's
    weights are found by their storage. FSDP2 keeps fp32 parameters and reduction here, which gives DDP's numbers.
    """
    from lightning.fabric import Fabric

    from lightning_accel.strategies.fsdp import FabricAcceleratedFSDPStrategy
    from lightning_accel.utils import FullyShardedDataParallelPlugin
    from tests.scripts.fp8_strategies import CPUFP8Precision

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="fp32")
    strategy = FabricAcceleratedFSDPStrategy(plugin) if fsdp2 else "acc_multi_cpu"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[CPUFP8Precision()])
    fabric.launch()
    torch.manual_seed(0)
    # Dimensions divisible by 16; Accelerate's default filter keeps the first and last Linear, so "2" runs in float8.
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 8, 16, generator=g)
    losses = []
    for batch in x[fabric.global_rank :: 2]:
        loss = nn.functional.mse_loss(model(batch), batch.roll(1, dims=1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = model.module[2].weight
    inner = getattr(weight, "_local_tensor", weight)
    return {
        "losses": losses,
        "float8_weight": type(inner).__name__,
        **_held_by_optimizer(model.module, optimizer.optimizer),
    }


def plain_ddp() -> dict[str, Any]:
    """The Fabric run's reference: plain torch DDP over the same batches (DistributedSampler, no shuffle)."""
    from torch.utils.data.distributed import DistributedSampler

    model = nn.parallel.DistributedDataParallel(net())
    optimizer = optimizer_for(model.module)
    data = loader()
    batches = DataLoader(data.dataset, batch_size=4, sampler=DistributedSampler(data.dataset, shuffle=False))
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}


def error(prepare: Callable[[Any], None], **plugins: Any) -> str:
    """The message of the ValueError that ``prepare(accelerator)`` raises (an AssertionError if it raises none)."""
    from lightning_accel import Accelerator

    reset_accelerator_states()
    try:
        prepare(Accelerator(cpu=True, **plugins))
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{prepare.__name__} raised no ValueError")


def split_flat_parameter(accelerator: Any) -> None:
    model = net()
    weight, bias = model[0].weight, model[0].bias  # FSDP1 flattens both into the first Linear's flat parameter
    rest = [p for m in list(model)[1:] for p in m.parameters()]
    optimizer = torch.optim.SGD([{"params": [weight, *rest]}, {"params": [bias], "lr": 0.5}], lr=0.1)
    accelerator.prepare(model, optimizer)


def foreign_tensor(accelerator: Any) -> None:
    model = net()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3, 5))], lr=0.1)
    accelerator.prepare(model, optimizer)


def stepped_optimizer(accelerator: Any) -> None:
    model = net()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    accelerator.prepare(model, optimizer)


def optimizer_before_a_separate_prepare(accelerator: Any) -> None:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator.prepare(model)
    accelerator.prepare(optimizer)


def _fsdp(version: int, **fields: Any) -> dict[str, Any]:
    from lightning_accel.utils import FullyShardedDataParallelPlugin

    return {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=version, **WRAP, **fields)}


def _zero(stage: int) -> dict[str, Any]:
    """ZeRO without clipping, as DDP here: only an explicit 0 in the config turns off DeepSpeed's default of 1.0."""
    from lightning_accel.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=stage, zero3_save_16bit_model=stage == 3)
    plugin.deepspeed_config["gradient_clipping"] = 0.0
    return {"deepspeed_plugin": plugin}


@contextlib.contextmanager
def _hidden(prefixes: tuple[str, ...]) -> Generator[None, None, None]:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(prefixes)}
    try:
        yield
    finally:
        os.environ.update(saved)


def matrix() -> dict[str, Any]:
    import importlib.util

    result: dict[str, Any] = {
        "hf": hf(),
        "fsdp2": ours(**_fsdp(2)),
        "fsdp1": ours(**_fsdp(1, use_orig_params=True)),
        "fsdp1_flat": ours(**_fsdp(1, use_orig_params=False)),
        "fabric_fsdp2": fabric_fsdp2(),
        "plain_ddp": plain_ddp(),
        "fp8_fsdp2": fabric_fp8(fsdp2=True),
        "fp8_ddp": fabric_fp8(fsdp2=False),
        "errors": {
            "split_flat_parameter": error(split_flat_parameter, **_fsdp(1, use_orig_params=False)),
            "foreign_tensor": error(foreign_tensor, **_fsdp(2)),
            "stepped_optimizer": error(stepped_optimizer, **_fsdp(2)),
            "separate_prepare_fsdp2": error(optimizer_before_a_separate_prepare, **_fsdp(2)),
            "separate_prepare_fsdp1_flat": error(
                optimizer_before_a_separate_prepare, **_fsdp(1, use_orig_params=False)
            ),
        },
    }
    if importlib.util.find_spec("deepspeed") is not None:  # last: DeepSpeed ends the run's process group
        result["zero1"] = ours(**_zero(1))
        result["zero2"] = ours(**_zero(2))
        result["zero3"] = ours(**_zero(3))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("matrix", "env"), default="matrix")
    args = parser.parse_args()
    result = matrix() if args.mode == "matrix" else {"hf": hf(fsdp_env_hidden=True), "env": ours_from_env()}
    rank = torch.distributed.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"one_call_rank{rank}.pt")

    from lightning_accel import Accelerator

    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main()
