"""Runs litgpt's ``pretrain.main``, unmodified, on a 2-layer GPT and synthetic tokens, with a strategy by name.

litgpt's own ``pretrain.setup`` hard-codes Lightning's ``FSDPStrategy`` (which refuses CPU), so this builds the
``Fabric`` a litgpt user would (``Fabric(strategy=...)``) and calls ``main`` with litgpt's own argument objects. It
starts its 2 CPU processes through Fabric's launcher. Modes:

- ``train``: ``pretrain.main`` from scratch (or ``--resume``, litgpt's ``resume=True``: the newest ``step-*``
  checkpoint in ``--out``); rank 0's per-step losses come from a ``CSVLogger`` under ``--out/logs``.
- ``load``: litgpt's ``utils.load_checkpoint`` of a plain state-dict file into a freshly set-up model (its
  ``isinstance(strategy, FSDPStrategy)`` branch calls ``fabric.load_raw``), then ``fabric.save`` of the model.

Run with the litgpt environment's interpreter: ``python pretrain_driver.py --strategy acc_fsdp --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from litgpt import Config
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import DataModule
from litgpt.model import GPT
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_accel  # registers the acc_* strategy names with Lightning
from lightning_accel.utils import FullyShardedDataParallelPlugin

SEQ = 32
MICRO_BATCH = 2
DEVICES = 2
ITERS = 16  # 8 optimizer steps of 2 accumulated micro-batches per process
SAVE_EVERY = 4  # steps: checkpoints step-00000004 and step-00000008


def model_config() -> Config:
    return Config.from_name(
        "pythia-14m", n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=64, padded_vocab_size=64
    )


class _Rows(Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


@dataclass
class SyntheticTokens(DataModule):
    """Seeded random token rows; the train loader is resumable (``StatefulDataLoader``), as litdata's is."""

    vocab_size: int = 64
    samples: int = 256
    seed: int = 1234
    batch_size: int = field(default=1, init=False)
    seq_length: int = field(default=SEQ + 1, init=False)

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None, **_: Any) -> None:
        self.batch_size = batch_size
        self.seq_length = (max_seq_length or SEQ) + 1

    def _rows(self, offset: int, count: int) -> _Rows:
        generator = torch.Generator().manual_seed(self.seed + offset)
        return _Rows(torch.randint(0, self.vocab_size, (count, self.seq_length), generator=generator))

    def train_dataloader(self) -> StatefulDataLoader:
        rows = self._rows(0, self.samples)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        sampler = DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=True, seed=self.seed)
        return StatefulDataLoader(rows, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self._rows(1, 8), batch_size=self.batch_size)


def strategy(name: str) -> Any:
    """``ddp``/``acc_ddp`` by name; ``acc_fsdp`` configured as litgpt configures Lightning's FSDP (full checkpoints,
    one unit per ``Block``); ``acc_fsdp_sharded`` is the plain name (sharded checkpoint directories)."""
    if name == "acc_fsdp":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            state_dict_type="FULL_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"],
        )
        return lightning_accel.strategy_for("FSDP", fabric=True, fsdp_plugin=plugin)
    return "acc_fsdp" if name == "acc_fsdp_sharded" else name


def make_fabric(name: str, out: Path) -> L.Fabric:
    logger = CSVLogger(root_dir=out / "logs", name="csv", version=0, flush_logs_every_n_steps=1)
    fabric = L.Fabric(
        accelerator="cpu", devices=DEVICES, strategy=strategy(name), precision="32-true", loggers=[logger]
    )
    fabric.launch()
    return fabric


def train(name: str, out: Path, resume: bool) -> None:
    from litgpt import pretrain

    fabric = make_fabric(name, out)
    train_args = TrainArgs(
        save_interval=SAVE_EVERY,
        log_interval=1,
        global_batch_size=MICRO_BATCH * DEVICES * 2,
        micro_batch_size=MICRO_BATCH,
        max_tokens=ITERS * MICRO_BATCH * SEQ * DEVICES,
        lr_warmup_steps=2,
        max_norm=1.0,
        min_lr=1e-4,
    )
    eval_args = EvalArgs(interval=1000, max_iters=2, initial_validation=False, final_validation=False)
    pretrain.main(
        fabric=fabric,
        devices=DEVICES,
        seed=42,
        initial_checkpoint_dir=None,
        resume=resume,
        config=model_config(),
        data=SyntheticTokens(),
        out_dir=out,
        tokenizer_dir=None,
        tokenizer=None,
        train=train_args,
        eval=eval_args,
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.1}},
    )


def load(name: str, out: Path, checkpoint: Path) -> None:
    from litgpt.utils import load_checkpoint

    fabric = make_fabric(name, out)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = GPT(model_config())
    model = fabric.setup(model)
    load_checkpoint(fabric, model, checkpoint)
    fabric.save(out / "loaded.pth", {"model": model})


def options() -> argparse.Namespace:
    """The driver's options, handed to the processes Fabric starts through the environment.

    ``pretrain.main`` saves its hyperparameters by parsing ``sys.argv`` with litgpt's own ``pretrain`` CLI
    (``parser_config.save_hyperparameters``), so it only runs under a command line that CLI accepts. The driver's
    options therefore travel in ``LITGPT_DRIVER`` and ``sys.argv`` becomes ``[script, "pythia-14m"]`` before Fabric
    starts the other process with the same command line.
    """
    if "LITGPT_DRIVER" in os.environ:
        saved = json.loads(os.environ["LITGPT_DRIVER"])
        return argparse.Namespace(
            **{k: None if v is None else (Path(v) if k in PATHS else v) for k, v in saved.items()}
        )
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=["ddp", "acc_ddp", "acc_fsdp", "acc_fsdp_sharded"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--load", type=Path, help="load this plain state-dict file with litgpt's load_checkpoint")
    args = parser.parse_args()
    os.environ["LITGPT_DRIVER"] = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    sys.argv[1:] = ["pythia-14m"]
    return args


PATHS = ("out", "load")


def main() -> None:
    args = options()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.load is not None:
        load(args.strategy, args.out, args.load)
    else:
        train(args.strategy, args.out, args.resume)


if __name__ == "__main__":
    main()
