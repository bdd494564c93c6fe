"""One transformers.Trainer run on a tiny random BERT and seeded synthetic data, as a user would write it.

The script is the same for both sides of the clients stage: it imports ``transformers`` (which imports
``accelerate``); the runner decides whether ``accelerate`` is Hugging Face's or lightning_accel (the alias).
It writes ``<out>/result.pt``: the final weights, the training losses, and (with ``--eval``) the evaluation
metrics and predictions.

Usage: ``python trainer_script.py --out DIR [--accum N] [--max-grad-norm X] [--deepspeed CFG.json] [--fsdp]
[--peft] [--eval] [--save-steps N] [--resume CHECKPOINT]`` (under ``torch.distributed.run`` for several processes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Synthetic(Dataset):
    """``size`` seeded sequences of token ids with a binary label that depends on them (learnable, deterministic)."""

    def __init__(self, size: int, seed: int, vocab: int = 64, length: int = 8) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (size, length), generator=generator)
        self.labels = (self.ids[:, 0] > vocab // 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0, task_type="SEQ_CLS")
    torch.manual_seed(1)
    return get_peft_model(model, config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=0.0)
    parser.add_argument("--deepspeed")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--peft", action="store_true")
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()

    from transformers import Trainer, TrainingArguments

    out = Path(args.out)
    model = tiny_bert()
    if args.peft:
        model = with_lora(model)
    training = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accum,
        max_grad_norm=args.max_grad_norm,
        learning_rate=1e-2,
        num_train_epochs=2,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        seed=42,
        data_seed=42,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        deepspeed=args.deepspeed,
        fsdp="full_shard" if args.fsdp else "",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Synthetic(32, 0), eval_dataset=Synthetic(7, 1))
    trainer.train(resume_from_checkpoint=args.resume)
    result: dict[str, object] = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "global_step": trainer.state.global_step,
    }
    if args.eval:
        result["metrics"] = trainer.evaluate()
        prediction = trainer.predict(Synthetic(7, 2))
        result["predictions"] = torch.as_tensor(prediction.predictions)
        result["label_ids"] = torch.as_tensor(prediction.label_ids)
    if args.save_model:
        trainer.save_model(str(out / "saved"))
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        result["weights"] = {k: v.detach().cpu().clone() for k, v in weights.items()}
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "result.pt")
    print(f"rank {os.environ.get('RANK', '0')}: done, {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
