"""A port of HF accelerate's ``examples/complete_nlp_example.py`` shape onto lightning_accel, on synthetic data.

Only the imports differ from an Accelerate script: the loop uses ``prepare``, ``accumulate``, ``backward``, a warmup
learning-rate schedule, ``gather_for_metrics`` for accuracy, ``save_state`` every epoch or every N steps, and resumes
from a checkpoint with ``load_state`` + ``skip_first_batches``. BERT on GLUE is replaced by an MLP on a synthetic
4-class task so it runs on CPU in seconds::

    python examples/accelerate_complete_example.py --cpu --output_dir /tmp/run --checkpointing_steps epoch
    python examples/accelerate_complete_example.py --cpu --output_dir /tmp/run --resume_from_checkpoint /tmp/run/epoch_0
    torchrun --nproc_per_node=2 examples/accelerate_complete_example.py --cpu   # 2 processes
"""

from __future__ import annotations

import argparse
import os
import re

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import Accelerator, DistributedType
from lightning_accel.utils import set_seed

NUM_FEATURES, NUM_CLASSES = 32, 4


def get_dataloaders(accelerator: Accelerator, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Synthetic train/eval splits whose label is the argmax of a fixed random projection."""
    with accelerator.main_process_first():  # (where the original tokenizes the dataset once)
        g = torch.Generator().manual_seed(0)
        projection = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=g)
        x = torch.randn(600, NUM_FEATURES, generator=g)
        y = (x @ projection).argmax(dim=1)
    train = TensorDataset(x[:500], y[:500])
    evaluation = TensorDataset(x[500:], y[500:])
    return (
        DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True),
        DataLoader(evaluation, shuffle=False, batch_size=batch_size * 2),
    )


def linear_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """What ``transformers.get_linear_schedule_with_warmup`` computes."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def training_function(config: dict[str, float | int], args: argparse.Namespace) -> float:
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=int(config["gradient_accumulation_steps"]),
    )
    checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps.isdigit() else None
    set_seed(int(config["seed"]))
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, int(config["batch_size"]))
    model = nn.Sequential(nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config["lr"]))
    num_epochs = int(config["num_epochs"])
    total_steps = len(train_dataloader) * num_epochs // int(config["gradient_accumulation_steps"])
    lr_scheduler = linear_warmup(optimizer, warmup=10, total=total_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        number = int(re.sub(r"\D", "", name))
        if name.startswith("epoch_"):
            starting_epoch = number + 1
        else:
            resume_step = number
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
        overall_step = starting_epoch * len(train_dataloader) + (resume_step or 0)

    accuracy = 0.0
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for x, y in active_dataloader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            if checkpointing_steps is not None and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))

        model.eval()
        correct = total = 0
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == references).sum())
            total += len(references)
        accuracy = correct / total
        accelerator.print(f"epoch {epoch}: accuracy={accuracy:.3f} over {total} samples")
        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    if accelerator.distributed_type != DistributedType.NO:
        accelerator.print(f"trained on {accelerator.num_processes} processes ({accelerator.distributed_type.value})")
    accelerator.end_training()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16", "fp8"], default=None)
    parser.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    parser.add_argument("--checkpointing_steps", default="", help="'epoch', a number of steps, or '' for none")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--output_dir", default=".")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16, "gradient_accumulation_steps": 2}
    training_function(config, args)


if __name__ == "__main__":
    main()
