"""Build the offline stand-ins that Accelerate's external_deps scripts load by hub name.

Usage: ``python build.py DIR``. Writes into ``DIR``:

- ``bert-base-cased/``: a tiny random BERT classifier (2 layers, hidden 32) and a BERT tokenizer over a small generated
  vocabulary, both saved with ``save_pretrained``; ``from_pretrained("bert-base-cased")`` loads a local folder of
  that name from the working directory before it looks at the hub.
- ``nyu-mll/glue/``: a synthetic GLUE/MRPC (sentence1, sentence2, label, idx; train, validation and test splits) as
  JSON lines with a README ``configs:`` block naming ``mrpc``; ``datasets.load_dataset("nyu-mll/glue", "mrpc")``
  resolves a local folder of that path first.
- ``glue/glue.py``: the ``evaluate`` metric for ``evaluate.load("glue", "mrpc")`` (``glue_metric.py`` beside this).
"""

import json
import random
import shutil
import sys
from pathlib import Path

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "ran",
    "flew",
    "on",
    "under",
    "over",
    "mat",
    "log",
    "tree",
    "quickly",
    "slowly",
    "today",
    "yesterday",
    "red",
    "blue",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Rows per split: a few steps at batch 16 over 2 processes (the scripts' own batch size).
ROWS = {"train": 64, "validation": 32, "test": 16}
README = """---
configs:
- config_name: mrpc
  data_files:
  - split: train
    path: mrpc/train.jsonl
  - split: validation
    path: mrpc/validation.jsonl
  - split: test
    path: mrpc/test.jsonl
---
Synthetic MRPC-shaped sentence pairs for offline runs (label 1 when the second sentence is the first reversed).
"""


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + " ."


def build_dataset(folder: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    (folder / "mrpc").mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(README)
    for split, rows in ROWS.items():
        lines = []
        for idx in range(rows):
            first = sentence(rng)
            label = int(rng.random() < 0.5)
            second = " ".join(reversed(first.split())) if label else sentence(rng)
            lines.append(json.dumps({"sentence1": first, "sentence2": second, "label": label, "idx": idx}))
        (folder / "mrpc" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def build_model(folder: Path) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: index for index, token in enumerate([*SPECIAL, *WORDS, "."])}
    tokenizer = BertTokenizer(vocab=vocab, do_lower_case=False, model_max_length=64)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
    )
    BertForSequenceClassification(config).save_pretrained(folder)


def main(out: Path) -> None:
    build_model(out / "bert-base-cased")
    build_dataset(out / "nyu-mll" / "glue")
    (out / "glue").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("glue_metric.py"), out / "glue" / "glue.py")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
