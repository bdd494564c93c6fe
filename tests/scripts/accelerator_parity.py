"""Run one Accelerate-style training script with HF accelerate's ``Accelerator`` and with lightning_accel's.

Launched once, with plain ``python`` (1 process) or under ``torch.distributed.run`` (2 CPU processes). Each variant
trains with the seedable sampler, gradient accumulation 2, SGD + StepLR, evaluates with ``gather_for_metrics`` and
saves automatically named checkpoints with ``total_limit=2``. Each rank then writes ``{variant}_rank{r}.pt`` for
``tests/parity/test_accelerator_parity.py``. A last phase resumes lightning_accel from HF accelerate's checkpoint and
from its
own, and HF accelerate loads lightning_accel's. The ``stateful`` phase saves mid-epoch with
``use_stateful_dataloader=True`` (two loaders), resumes in a fresh ``Accelerator`` and records the batches and weights
against an uninterrupted run, for both frameworks (lightning_accel also mid-epoch 1 and from HF's checkpoint).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import reset_accelerator_states

DATA_SEED = 11
EPOCHS = 2


def datasets() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    x, xe = torch.randn(33, 8, generator=g), torch.randn(11, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, x @ w), TensorDataset(xe, xe @ w)


class Counter:
    """A registered custom object."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def build(accelerate: Any, project_dir: Path) -> tuple[Any, ...]:
    utils = accelerate.utils
    accelerator = accelerate.Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=utils.DataLoaderConfiguration(use_seedable_sampler=True, data_seed=DATA_SEED),
        project_config=utils.ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    train, evaluation = datasets()
    train_dl = DataLoader(train, batch_size=4, shuffle=True)
    eval_dl = DataLoader(evaluation, batch_size=4)
    prepared = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return (accelerator, *prepared, counter)


def train(accelerate: Any, project_dir: Path) -> dict[str, Any]:
    accelerator, model, optimizer, train_dl, eval_dl, scheduler, counter = build(accelerate, project_dir)
    losses, syncs, eval_counts = [], [], []
    for _ in range(EPOCHS):
        model.train()
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            syncs.append(accelerator.sync_gradients)
        counter.value += 1
        accelerator.save_state()
        model.eval()
        seen = 0
        with torch.no_grad():
            for x, _ in eval_dl:
                seen += accelerator.gather_for_metrics(model(x)).shape[0]
        eval_counts.append(seen)
    accelerator.save_state()
    accelerator.wait_for_everyone()
    checkpoints = project_dir / "checkpoints"
    return {
        "losses": losses,
        "syncs": syncs,
        "eval_counts": eval_counts,
        "lr": scheduler.get_last_lr(),
        "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "folders": sorted(os.listdir(checkpoints)),
        "files": {f: sorted(os.listdir(checkpoints / f)) for f in sorted(os.listdir(checkpoints))},
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "save_iteration": accelerator.save_iteration,
    }


def resume(hf_checkpoint: Path, project_dir: Path) -> dict[str, Any]:
    """lightning_accel loads HF accelerate's last checkpoint, then its own, then saves once more."""
    import lightning_accel

    accelerator, model, _, _, _, scheduler, counter = build(lightning_accel, project_dir)
    accelerator.load_state(str(hf_checkpoint))
    from_hf = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    hf = {"lr": scheduler.get_last_lr(), "counter": counter.value, "weights": from_hf}
    accelerator.load_state()
    own = {"save_iteration": accelerator.save_iteration, "step": accelerator.step}
    next_dir = accelerator.save_state()
    return {"from_hf": hf, "own": own, "next_save": Path(next_dir).name}


def hf_loads_ours(checkpoint: Path, project_dir: Path) -> dict[str, Any]:
    """HF accelerate loads lightning_accel's checkpoint."""
    import accelerate

    accelerator, model, _, _, _, scheduler, counter = build(accelerate, project_dir)
    accelerator.load_state(str(checkpoint))
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"lr": scheduler.get_last_lr(), "counter": counter.value, "weights": weights}


def indexed(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(torch.arange(n), x, x.sum(1, keepdim=True))


def stateful_build(accelerate: Any) -> tuple[Any, ...]:
    config = accelerate.utils.DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=DATA_SEED
    )
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(7)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_dl = DataLoader(indexed(20, 1), batch_size=2, shuffle=True)
    eval_dl = DataLoader(indexed(6, 2), batch_size=3)  # a second stateful loader: dl_state_dict_1.bin
    model, optimizer, train_dl, _ = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    return accelerator, model, optimizer, train_dl


def stateful_steps(accelerator: Any, model: Any, optimizer: Any, loader: Any, limit: int) -> list[list[int]]:
    """Train on up to ``limit`` batches (over at most ``EPOCHS`` passes); returns each batch's sample indices."""
    seen: list[list[int]] = []
    for _ in range(EPOCHS):
        for index, x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            seen.append(index.tolist())
            if len(seen) == limit:
                return seen
    return seen


def stateful_weights(accelerator: Any, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def stateful_resume(accelerate: Any, checkpoint: Path, stop: int, total: int, save: bool = True) -> dict[str, Any]:
    """Train ``stop`` batches and save (or take ``checkpoint`` as saved after them), then resume in a fresh run."""
    before, files = [], None
    if save:
        reset_accelerator_states()
        accelerator, model, optimizer, loader = stateful_build(accelerate)
        before = stateful_steps(accelerator, model, optimizer, loader, stop)
        accelerator.save_state(str(checkpoint))
        accelerator.wait_for_everyone()  # HF accelerate returns before the other processes wrote their files
        files = sorted(os.listdir(checkpoint))
    reset_accelerator_states()
    accelerator, model, optimizer, loader = stateful_build(accelerate)
    accelerator.load_state(str(checkpoint))
    rest = stateful_steps(accelerator, model, optimizer, loader, total - stop)
    return {"files": files, "before": before, "rest": rest, "weights": stateful_weights(accelerator, model)}


def stateful(out: Path) -> dict[str, Any]:
    """Mid-epoch save and resume with stateful loaders, under both frameworks (see the module docstring)."""
    import accelerate

    import lightning_accel

    result: dict[str, Any] = {}
    for name, module in (("hf", accelerate), ("ours", lightning_accel)):
        reset_accelerator_states()
        accelerator, model, optimizer, loader = stateful_build(module)
        per_epoch = len(loader)
        full = stateful_steps(accelerator, model, optimizer, loader, EPOCHS * per_epoch)
        result[name] = {"full": full, "weights": stateful_weights(accelerator, model), "per_epoch": per_epoch}
        stops = {"epoch0": 3} if name == "hf" else {"epoch0": 3, "epoch1": per_epoch + 2}
        for label, stop in stops.items():
            result[name][label] = stateful_resume(module, out / f"stateful_{name}_{label}", stop, len(full))
    # lightning_accel continues HF accelerate's mid-epoch-0 checkpoint (3 batches in).
    checkpoint = out / "stateful_hf_epoch0"
    result["ours"]["from_hf"] = stateful_resume(lightning_accel, checkpoint, 3, len(full), save=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out: Path = parser.parse_args().out
    rank = int(os.environ.get("RANK", "0"))

    import accelerate

    import lightning_accel

    results = {}
    for name, module in (("hf", accelerate), ("ours", lightning_accel)):
        reset_accelerator_states()
        results[name] = train(module, out / name)
    reset_accelerator_states()
    results["resume"] = resume(out / "hf" / "checkpoints" / results["hf"]["folders"][-1], out / "ours")
    reset_accelerator_states()
    results["hf_loads_ours"] = hf_loads_ours(out / "ours" / "checkpoints" / "checkpoint_2", out / "hf_resume")
    results["stateful"] = stateful(out)
    for name, result in results.items():
        torch.save(result, out / f"{name}_rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
