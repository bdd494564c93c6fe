"""What ``prepare`` returns under DDP and DeepSpeed, used as Accelerate's own objects are, with HF accelerate's numbers.

Run under ``torch.distributed.run`` with 2 CPU processes. Both frameworks, one after the other in each process, for
``ddp``; ``deepspeed`` runs lightning_accel only (HF accelerate 1.15 builds a CPU DeepSpeed engine here for one process
only, outside ``transformers.Trainer``: the clients stage compares the Trainer's ZeRO runs with HF's), against plain
PyTorch on one process (``plain_deepspeed_rank0.pt``); ``sharded`` is lightning_accel's global gradient norm under
FSDP1 and FSDP2 against DDP's:

- ``ddp``: the prepared model's own ``no_sync()`` (DDP's, which Accelerate's ``prepare`` returns) around the first of
  two micro-batches, ``clip_grad_norm_`` over the parameters in reverse order, SGD steps;
- ``deepspeed``: ZeRO-2 through ``accumulate``/``backward``/``clip_grad_norm_``, then the
  returned engine's ``save_checkpoint``, ``get_global_grad_norm``, ``config``, one more step and ``load_checkpoint``,
  and ``get_state_dict``/``unwrap_model``/``save_state``/``load_state`` on the engine.

Each rank writes ``{framework}_{phase}_rank{r}.pt`` for ``tests/unit/accelerator/test_engine_ddp.py``.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import reset_accelerator_states


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def network() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def weights(accelerator: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}


def ddp(accelerate: Any) -> dict[str, Any]:
    accelerator = accelerate.Accelerator(cpu=True)
    net = network()
    model, optimizer, loader = accelerator.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data(), batch_size=4)
    )
    norms, unsynced = [], []
    for i, (x, y) in enumerate(loader):
        with model.no_sync() if i % 2 == 0 else nullcontext():
            accelerator.backward(nn.functional.mse_loss(model(x), y))
        if i % 2 == 0:  # the gradients of this rank alone: they differ between the ranks
            grads = accelerator.gather(model.module[0].weight.grad.reshape(1, -1))
            unsynced.append(not torch.equal(grads[0], grads[1]))
            continue
        norms.append(accelerator.clip_grad_norm_(list(model.parameters())[::-1], 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
    return {
        "weights": weights(accelerator, model),
        "norms": norms,
        "unsynced": unsynced,
        "module_is_user_model": accelerator.unwrap_model(model) is net and model.module is net,
    }


def deepspeed_phase(accelerate: Any, folder: Path) -> dict[str, Any]:
    import deepspeed

    plugin = accelerate.utils.DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.5, gradient_accumulation_steps=1)
    accelerator = accelerate.Accelerator(deepspeed_plugin=plugin)
    net = network()
    model, optimizer, loader = accelerator.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data(), batch_size=4)
    )
    norms = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5))
            optimizer.step()
            optimizer.zero_grad()
    result: dict[str, Any] = {
        "is_engine": isinstance(model, deepspeed.DeepSpeedEngine),
        "optimizer_wrapper": isinstance(optimizer, accelerate.utils.DeepSpeedOptimizerWrapper),
        "engine_wrapped": accelerator.deepspeed_engine_wrapped is not None,
        "config_stage": model.config["zero_optimization"]["stage"],
        "engine_norm": float(model.get_global_grad_norm()),
        "norms": norms,
        "weights": weights(accelerator, model),
        "unwrapped_is_user_model": accelerator.unwrap_model(model) is net,
    }
    with accelerator.no_sync(model):  # takes the engine too
        pass
    model.save_checkpoint(str(folder / "engine"))
    accelerator.save_state(str(folder / "state"))
    x, y = next(iter(loader))
    for _ in range(2):  # one more optimizer step
        accelerator.backward(nn.functional.mse_loss(model(x), y))
    moved = weights(accelerator, model)
    model.load_checkpoint(str(folder / "engine"))
    result["after_load_checkpoint"] = weights(accelerator, model)
    result["moved"] = any(not torch.equal(moved[k], result["weights"][k]) for k in moved)
    for _ in range(2):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
    accelerator.load_state(str(folder / "state"))
    result["after_load_state"] = weights(accelerator, model)
    return result


def sharded_norms(accelerate: Any) -> dict[str, float]:
    """``clip_grad_norm_`` over a whole model under DDP, FSDP1 and FSDP2, each rank with its own batch."""
    norms = {}
    for name, version in (("ddp", None), ("fsdp1", 1), ("fsdp2", 2)):
        reset_accelerator_states()
        plugin = None if version is None else accelerate.utils.FullyShardedDataParallelPlugin(fsdp_version=version)
        accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
        accelerator.backward(model(x).pow(2).mean())
        norms[name] = float(accelerator.clip_grad_norm_(model.parameters(), 0.1))
    return norms


def plain_clipped_sgd() -> dict[str, Any]:
    """The DeepSpeed phase's training as one process of plain PyTorch: both ranks' batches together, clipped at 0.5."""
    net = network()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    norms = []
    for x, y in DataLoader(data(), batch_size=8):  # rank 0 gets batches 0, 2, ..., rank 1 the odd ones
        nn.functional.mse_loss(net(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()}, "norms": norms}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    import accelerate

    import lightning_accel

    rank = int(os.environ["RANK"])
    torch.save(deepspeed_phase(lightning_accel, out / "ours"), out / f"ours_deepspeed_rank{rank}.pt")
    for name, module in (("hf", accelerate), ("ours", lightning_accel)):
        reset_accelerator_states()
        torch.save(ddp(module), out / f"{name}_ddp_rank{rank}.pt")
    torch.save(sharded_norms(lightning_accel), out / f"ours_sharded_rank{rank}.pt")
    if rank == 0:
        torch.save(plain_clipped_sgd(), out / "plain_deepspeed_rank0.pt")
    reset_accelerator_states()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
