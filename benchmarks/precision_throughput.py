"""Training throughput (tokens/s) of a GPT-style model under each precision, side by side with Lightning's bf16-mixed.

One process, one device, the Trainer. Variants, each a fresh seeded model on the same synthetic tokens:

- ``lightning_bf16``: Lightning's own ``precision="bf16-mixed"`` on its ``auto`` strategy (the reference);
- ``acc_fp32``, ``acc_bf16``, ``acc_fp8``: ``acc_no`` with ``FP32Precision``, ``BF16Precision``, ``FP8Precision``
  (torchao's ``Float8Linear``, Accelerate's default filter);
- ``acc_bf16_compile``, ``acc_fp8_compile``: the same under ``TorchDynamoPlugin(backend="inductor")`` with regional
  compilation (each transformer block compiled once; ``--full-compile`` compiles the whole network instead; on CPU
  the backend defaults to ``aot_eager``, as inductor's C++ compilation would take minutes there).

The first ``--warmup`` steps of every run (compilation, allocator and autotuning warm-up) are not timed; CUDA is
synchronized at both ends of the timed window. With ``--rounds`` > 1 the variants are interleaved in rounds and the
median is kept. Ratios printed: acc bf16 / Lightning bf16-mixed (target >= 0.99) and fp8 + compile / bf16 eager
(target >= 1.3 on an H100/H200-class GPU); fp8 rows are skipped, with the library's reason, where fp8 cannot run.

Sizes: ``150m`` (default: d_model 768, 16 blocks, 12 heads, vocabulary 50304, sequence 1024, batch 8, ~152M
parameters with the head tied to the embedding) for a GPU; ``small`` (d_model 64, 2 blocks, sequence 64) runs on
CPU in well under a minute. Run::

    python benchmarks/precision_throughput.py --out results.json              # GPU
    python benchmarks/precision_throughput.py --size small --steps 3          # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.config import TorchDynamoPlugin
from lightning_accel.precision import BF16Precision, FP8Precision, FP32Precision
from lightning_accel.strategies.single_device import AcceleratedSingleDeviceStrategy


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int


SIZES = {
    "150m": GPTConfig(vocab=50304, d_model=768, layers=16, heads=12, seq=1024, batch=8),
    "small": GPTConfig(vocab=512, d_model=64, layers=2, heads=4, seq=64, batch=4),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm, head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tokens.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LanguageModel(L.LightningModule):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.net = GPT(cfg)
        self.last_loss: torch.Tensor | None = None  # kept on the device: no sync inside the timed window

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        logits = self.net(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1, fused=torch.cuda.is_available())


class Timer(L.Callback):
    """Wall time of the steps after ``warmup``, with the device synchronized at both ends."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps - 1
        self.start = self.stop = math.nan

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step - 1
        if step in (self.warmup - 1, self.last):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if step == self.warmup - 1:
                self.start = time.perf_counter()
            else:
                self.stop = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.stop - self.start


@dataclass(frozen=True)
class Variant:
    name: str
    trainer_kwargs: Callable[[argparse.Namespace], dict[str, Any]]
    fp8: bool = False


def compiled(args: argparse.Namespace) -> AcceleratedSingleDeviceStrategy:
    plugin = TorchDynamoPlugin(backend=args.compile_backend, use_regional_compilation=not args.full_compile)
    return AcceleratedSingleDeviceStrategy(dynamo_plugin=plugin)


VARIANTS = (
    Variant("lightning_bf16", lambda a: {"strategy": "auto", "precision": "bf16-mixed"}),
    Variant("acc_fp32", lambda a: {"strategy": "acc_no", "plugins": [FP32Precision()]}),
    Variant("acc_bf16", lambda a: {"strategy": "acc_no", "plugins": [BF16Precision()]}),
    Variant("acc_bf16_compile", lambda a: {"strategy": compiled(a), "plugins": [BF16Precision()]}),
    Variant("acc_fp8", lambda a: {"strategy": "acc_no", "plugins": [FP8Precision()]}, fp8=True),
    Variant("acc_fp8_compile", lambda a: {"strategy": compiled(a), "plugins": [FP8Precision()]}, fp8=True),
)


def fp8_unavailable(device_type: str) -> str | None:
    """Why fp8 cannot run here, in the library's own words, or ``None`` when it can."""
    try:
        FP8Precision(device=device_type)
    except (ValueError, ModuleNotFoundError) as err:
        return str(err)
    return None


def synthetic_tokens(cfg: GPTConfig, batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batches * cfg.batch, cfg.seq + 1), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=cfg.batch, shuffle=False)


def run(variant: Variant, cfg: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; tokens/s over the timed steps, final loss and peak CUDA memory."""
    gc.collect()
    torch._dynamo.reset()  # every compiled run compiles afresh (no recompilation limit hit, no stale graphs)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    module = LanguageModel(cfg)
    timer = Timer(args.warmup, args.steps)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **variant.trainer_kwargs(args),
    )
    trainer.fit(module, synthetic_tokens(cfg, args.warmup + args.steps))
    return {
        "tokens_per_s": args.steps * cfg.batch * cfg.seq / timer.seconds,
        "final_loss": math.nan if module.last_loss is None else float(module.last_loss),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def ratio(results: dict[str, Any], numerator: str, denominator: str) -> float | None:
    top, bottom = results.get(numerator, {}), results.get(denominator, {})
    if "tokens_per_s" not in top or "tokens_per_s" not in bottom:
        return None
    return float(top["tokens_per_s"] / bottom["tokens_per_s"])


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def report(results: dict[str, Any], ratios: dict[str, float | None]) -> None:
    print(f"\n{'variant':<20} {'tokens/s':>12} {'final loss':>11} {'peak GiB':>9}")
    for name, row in results.items():
        if "skipped" in row:
            print(f"{name:<20} {'skipped':>12}  {row['skipped']}")
            continue
        memory = "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.1f}"
        print(f"{name:<20} {row['tokens_per_s']:>12,.0f} {row['final_loss']:>11.3f} {memory:>9}")
    for label, value in ratios.items():
        print(f"{label:<45} {'n/a' if value is None else f'{value:.3f}'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (150m: 20, small: 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (150m: 5, small: 2)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median is kept")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=None)
    parser.add_argument("--full-compile", action="store_true", help="compile whole networks, not block by block")
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    big = args.size == "150m"
    args.steps = (20 if big else 10) if args.steps is None else args.steps
    args.warmup = (5 if big else 2) if args.warmup is None else args.warmup
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be >= 1, got {args.steps} and {args.warmup}.")
    args.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    # On CPU, inductor's C++ compilation alone takes minutes on a small machine; aot_eager still traces the model.
    args.compile_backend = args.compile_backend or ("inductor" if args.accelerator == "cuda" else "aot_eager")
    return args


def summarize(samples: dict[str, list[dict[str, Any]]], skipped: dict[str, str]) -> dict[str, Any]:
    """One row per variant: the run with the median tokens/s (the median itself), or why it has no number."""
    results: dict[str, Any] = {}
    for name, runs in samples.items():
        if name in skipped or not runs:
            results[name] = {"skipped": skipped.get(name, "not run")}
            continue
        median = statistics.median(r["tokens_per_s"] for r in runs)
        results[name] = {**min(runs, key=lambda r: abs(r["tokens_per_s"] - median)), "tokens_per_s": median}
    return results


def ratios_of(results: dict[str, Any]) -> dict[str, float | None]:
    return {
        "acc_bf16 / lightning_bf16 (target >= 0.99)": ratio(results, "acc_bf16", "lightning_bf16"),
        "acc_fp8_compile / acc_bf16 (target >= 1.3)": ratio(results, "acc_fp8_compile", "acc_bf16"),
        "acc_fp8_compile / acc_bf16_compile": ratio(results, "acc_fp8_compile", "acc_bf16_compile"),
        "acc_fp32 / acc_bf16": ratio(results, "acc_fp32", "acc_bf16"),
    }


def save(args: argparse.Namespace, cfg: GPTConfig, results: dict[str, Any], complete: bool) -> None:
    """Write the JSON (after every run, so a run cut short by a time limit still leaves its numbers)."""
    if args.out is None:
        return
    payload = {"machine": machine(), "size": args.size, "config": asdict(cfg), "parameters": args.parameters}
    payload |= {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "complete": complete}
    payload |= {"compile_backend": args.compile_backend, "full_compile": args.full_compile}
    args.out.write_text(json.dumps(payload | {"results": results, "ratios": ratios_of(results)}, indent=2))


def main() -> None:
    args = parse_args()
    cfg = SIZES[args.size]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (FP32Precision's default)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with torch.device("meta"):
        args.parameters = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"{machine()}\nGPT {args.size}: {args.parameters / 1e6:.1f}M parameters, {asdict(cfg)}\n"
        f"{args.steps} timed steps after {args.warmup} warm-up steps, {args.rounds} round(s), compile backend"
        f" {args.compile_backend} ({'whole networks' if args.full_compile else 'regional: block by block'})",
        flush=True,
    )
    chosen = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
    samples: dict[str, list[dict[str, Any]]] = {v.name: [] for v in chosen}
    fp8_reason = fp8_unavailable(args.accelerator)
    skipped = {v.name: fp8_reason for v in chosen if v.fp8 and fp8_reason}
    for round_index in range(args.rounds):
        for variant in [v for v in chosen if v.name not in skipped]:
            try:
                samples[variant.name].append(run(variant, cfg, args))
            except Exception as err:  # one failing variant must not hide the others' numbers
                skipped[variant.name] = f"failed: {type(err).__name__}: {err}"
            row = skipped.get(variant.name) or samples[variant.name][-1]
            print(f"round {round_index + 1}: {variant.name}: {row}", flush=True)
            save(args, cfg, summarize(samples, skipped), complete=False)
    results = summarize(samples, skipped)
    report(results, ratios_of(results))
    save(args, cfg, results, complete=True)


if __name__ == "__main__":
    main()
