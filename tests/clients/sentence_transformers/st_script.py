"""One ``SentenceTransformerTrainer`` run: a tiny random BERT with mean pooling, MultipleNegativesRankingLoss and an
embedding-similarity evaluator, as a sentence-transformers user would write it.

The same script runs on both sides of the clients stage; the runner decides whether ``accelerate`` is Hugging Face's
or lightning_accel (the alias). The model and its word-level tokenizer are built in code and saved to a local folder
(nothing is downloaded); the pairs are seeded. It writes ``<out>/result.pt`` on process 0: the final weights, the
logged losses, the optimizer steps and the evaluator's metrics (during training and after it).

Usage: ``python st_script.py --out DIR`` (under ``torch.distributed.run`` for several processes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

WORDS = [a + b for a in "abcde" for b in "fghijklm"]  # 40 lower-case words, one token each


def local_bert(folder: Path) -> Path:
    """A 2-layer random BERT and its tokenizer, saved with ``save_pretrained`` (what a Hub id would hold)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(tokens)}).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return folder


def sentence(generator: torch.Generator) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (4,), generator=generator))


def data() -> tuple[Any, Any]:
    """Seeded (anchor, positive) pairs, the positive sharing the anchor's first two words; scored pairs to evaluate."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(3)
    anchors = [sentence(generator) for _ in range(32)]
    positives = [" ".join(a.split()[:2] + sentence(generator).split()[:2]) for a in anchors]
    train = Dataset.from_dict({"anchor": anchors, "positive": positives})
    others = [sentence(generator) for _ in range(8)]
    scored = {"sentence1": anchors[:8] * 2, "sentence2": positives[:8] + others, "score": [1.0] * 8 + [0.0] * 8}
    return train, scored


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
        models,
    )
    from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator

    out = Path(args.out)
    folder = local_bert(out / f"bert_rank{os.environ.get('RANK', '0')}")
    transformer = models.Transformer(str(folder), max_seq_length=16)
    model = SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_word_embedding_dimension())])
    train, scored = data()
    evaluator = EmbeddingSimilarityEvaluator(scored["sentence1"], scored["sentence2"], scored["score"], name="pairs")
    training = SentenceTransformerTrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_steps=6,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        seed=42,
        data_seed=42,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training,
        train_dataset=train,
        loss=losses.MultipleNegativesRankingLoss(model),
        evaluator=evaluator,
    )
    trainer.train()
    history = trainer.state.log_history
    result: dict[str, Any] = {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "global_step": trainer.state.global_step,
        "evaluations": [{k: v for k, v in e.items() if k.startswith("eval_pairs")} for e in history if "epoch" in e],
        "final_evaluation": evaluator(model),
    }
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        result["weights"] = {k: v.detach().cpu().clone() for k, v in weights.items()}
        torch.save(result, out / "result.pt")
    print(f"rank {os.environ.get('RANK', '0')}: done, {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
