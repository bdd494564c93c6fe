"""An Accelerate example program in the style of Accelerate's ``examples/`` (our own, much smaller).

A tiny random BERT classifier (built from a config, no download) trains on synthetic token sequences at 2 processes:
prepare, train with a warm-up schedule, evaluate with ``gather_for_metrics``; the modes add what the ``by_feature``
examples add. Written for ``accelerate``; the client runs it unchanged with ``accelerate`` resolved to lightning_accel.

Modes (``--modes``, run one after the other in this launch, each with a fresh ``Accelerator``):

- ``nlp``: the plain loop (``nlp_example.py``).
- ``accumulate``: ``Accelerator(gradient_accumulation_steps=2)`` with ``accelerator.accumulate(model)``.
- ``no_sync``: local accumulation by hand, ``with model.no_sync():`` on the steps that do not update.
- ``checkpoint``: ``save_state`` every ``CHECKPOINT_EVERY`` steps into ``step_<n>`` (``complete_nlp_example.py``),
  uninterrupted.
- ``resume``: a fresh run that loads ``step_<RESUME_STEP>`` of a ``checkpoint`` run (``--checkpoints``), skips the
  batches of the interrupted epoch already seen (``skip_first_batches``) and trains to the end.

The main process writes ``<mode>.pt``: the final weights of the unwrapped model and the evaluation accuracy per epoch.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

SEED = 42
EPOCHS = 3
BATCH_SIZE = 8
SAMPLES = 64
SEQUENCE = 12
VOCAB = 64
CHECKPOINT_EVERY = 3
RESUME_STEP = 6  # in the second of the four steps of epoch 1: a mid-epoch resume


class Tokens(Dataset):
    """Seeded random token sequences with padding; the label depends on the tokens."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQUENCE), generator=generator)
        lengths = torch.randint(SEQUENCE // 2, SEQUENCE + 1, (SAMPLES,), generator=generator)
        self.mask = (torch.arange(SEQUENCE)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = (self.ids[:, 0] > VOCAB // 2).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


def build(accelerator: Accelerator) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader, DataLoader, object]:
    from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQUENCE,
        num_labels=2,
    )
    set_seed(SEED)
    model = BertForSequenceClassification(config)
    train = DataLoader(Tokens(1), batch_size=BATCH_SIZE, shuffle=True)
    evaluation = DataLoader(Tokens(2), batch_size=BATCH_SIZE * 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = EPOCHS * len(train) // accelerator.num_processes // accelerator.gradient_accumulation_steps
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    return accelerator.prepare(model, optimizer, train, evaluation, scheduler)


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for batch in loader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += int((predictions == labels).sum())
        total += labels.numel()
    model.train()
    return correct / total


def train(mode: str, out: Path, checkpoints: Path) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2 if mode == "accumulate" else 1)
    model, optimizer, train_loader, eval_loader, scheduler = build(accelerator)
    first_epoch, skip = 0, 0
    if mode == "resume":
        accelerator.load_state(str(checkpoints / f"step_{RESUME_STEP}"))
        first_epoch, skip = divmod(RESUME_STEP, len(train_loader))
    step, accuracy = first_epoch * len(train_loader) + skip, []
    for epoch in range(first_epoch, EPOCHS):
        loader = accelerator.skip_first_batches(train_loader, skip) if epoch == first_epoch and skip else train_loader
        for index, batch in enumerate(loader, start=skip if epoch == first_epoch else 0):
            one_step(mode, accelerator, model, optimizer, scheduler, batch, index)
            step += 1
            if mode == "checkpoint" and step % CHECKPOINT_EVERY == 0:
                accelerator.save_state(str(checkpoints / f"step_{step}"))
        accuracy.append(evaluate(accelerator, model, eval_loader))
    accelerator.wait_for_everyone()
    weights = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    if accelerator.is_main_process:
        torch.save({"weights": weights, "accuracy": accuracy}, out / f"{mode}.pt")


def one_step(mode: str, accelerator: Accelerator, model, optimizer, scheduler, batch, index: int) -> None:
    if mode == "accumulate":
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        return
    if mode == "no_sync":
        if index % 2 == 0:  # the first of two micro-batches: accumulate locally, no all-reduce
            with model.no_sync():
                accelerator.backward(model(**batch).loss / 2)
            return
        accelerator.backward(model(**batch).loss / 2)
    else:
        accelerator.backward(model(**batch).loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", required=True)
    args = parser.parse_args()
    for mode in args.modes:
        try:
            train(mode, args.out, args.checkpoints)
        except Exception as error:  # recorded; the next mode still runs (the modes that fail do so on every rank)
            rank = os.environ.get("RANK", "0")
            (args.out / f"{mode}.rank{rank}.error").write_text(f"{type(error).__name__}: {error}"[:400])
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()


if __name__ == "__main__":
    main()
