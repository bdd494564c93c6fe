"""Every Trainer entry point, and their sequences on one Trainer, under each ``acc_*`` strategy and Lightning's own.

Run under ``torch.distributed.run`` with 2 processes (or imported by an in-process test with one device). Each variant
drives one or two Trainers through a sequence of ``fit``, ``validate``, ``test`` and ``predict`` calls and records
what each call gave: the full weights after a ``fit``, the metrics ``validate``/``test`` returned, this rank's
predictions. Each rank saves ``{variant}_rank{r}.pt`` for ``tests/launch/test_entry_points.py`` to compare with ``ddp``.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the acc_* names)
from lightning_accel.config import DeepSpeedPlugin, FullyShardedDataParallelPlugin

STEPS = 3
BATCH = 4
# fit -> validate -> test -> predict -> fit (continued) -> validate, all on one Trainer
FIT_FIRST = ("fit", "validate", "test", "predict", "fit", "validate")
# the evaluation entry points before any fit, then fit and predict on the same Trainer
EVAL_FIRST = ("validate", "test", "predict", "fit", "predict")


def data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :2].sum(1, keepdim=True) > 0).float())


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


with torch.device("meta"):
    NUMEL = sum(p.numel() for p in network().parameters())


class Classifier(L.LightningModule):
    """A tiny network whose every entry point gives a number that depends on the current weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = network()

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(1234, 32), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(99, 16), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(data(98, 16), batch_size=BATCH)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(data(97, 16), batch_size=BATCH)


def full_weights(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The module's whole weights on every rank, however the strategy holds them (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    model = trainer.strategy.model
    assert model is not None
    if any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules()):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: torch.as_tensor(v).detach().clone() for k, v in state.items()}
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        context: Any = deepspeed.zero.GatheredParameters(partitioned)
    else:
        context = nullcontext()
    with context:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def local_fraction(trainer: L.Trainer) -> float:
    """The share of the parameter elements this rank holds in the strategy's model (1.0 when nothing is sharded)."""
    model = trainer.strategy.model
    assert model is not None
    local = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO 3
            local += p.ds_tensor.numel()
        elif hasattr(p, "to_local"):  # FSDP2's DTensor
            local += p.to_local().numel()
        else:  # FSDP1's flat parameter holds this rank's shard
            local += p.numel()
    return local / NUMEL


def hook_count(module: L.LightningModule) -> int:
    """Hooks on the module's submodules and parameters: an engine or wrapper left behind by an earlier call shows."""
    modules = sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_pre_hooks) + len(m._backward_hooks)
        for m in module.modules()
    )
    parameters = sum(
        len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {}) for p in module.parameters()
    )
    return modules + parameters


def run_call(trainer: L.Trainer, module: L.LightningModule, call: str) -> Any:
    if call == "fit":
        # a second fit continues for STEPS more steps
        trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + STEPS
        trainer.fit(module)
        return {"global_step": trainer.global_step, "weights": full_weights(trainer, module)}
    if call == "predict":
        predictions = trainer.predict(module)
        assert predictions is not None
        return torch.cat([torch.as_tensor(p) for p in predictions]).detach().clone()
    return getattr(trainer, call)(module)


def run_sequence(strategy: Any, calls: tuple[str, ...], devices: int) -> dict[str, Any]:
    """One Trainer, one model, ``calls`` in order; the strategy is built fresh from ``strategy()`` if callable."""
    L.seed_everything(42)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy() if callable(strategy) else strategy,
        max_steps=STEPS,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Classifier()
    record: dict[str, Any] = {"calls": [], "local_fractions": [], "hooks": [], "error": None}
    for call in calls:
        try:
            record["calls"].append((call, run_call(trainer, module, call)))
            record["local_fractions"].append(local_fraction(trainer))
            record["hooks"].append(hook_count(module))
        except Exception as err:  # the test shows where and how a call failed
            record["error"] = (
                f"{call} (after {[c for c, _ in record['calls']]}):\n"
                + "".join(traceback.format_exception(err))[-4000:]
            )
            break
    record["strategy_class"] = type(trainer.strategy).__name__
    return record


def run_variant(strategy: Any, devices: int = 2, eval_first: bool = True) -> dict[str, Any]:
    result = {"fit_first": run_sequence(strategy, FIT_FIRST, devices)}
    if eval_first:
        result["eval_first"] = run_sequence(strategy, EVAL_FIRST, devices)
    return result


def fsdp(version: int) -> Callable[[], Any]:
    from lightning_accel.strategies import AcceleratedFSDPStrategy

    return lambda: AcceleratedFSDPStrategy(FullyShardedDataParallelPlugin(fsdp_version=version))


def deepspeed(stage: int) -> Callable[[], Any]:
    from lightning_accel.strategies.deepspeed import AcceleratedDeepSpeedStrategy

    return lambda: AcceleratedDeepSpeedStrategy(DeepSpeedPlugin(zero_stage=stage))


VARIANTS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": lambda: run_variant("ddp"),
    "acc_multi_cpu": lambda: run_variant("acc_multi_cpu"),
    "acc_ddp": lambda: run_variant("acc_ddp"),
    "fsdp2": lambda: run_variant("acc_fsdp"),
    "fsdp1": lambda: run_variant(fsdp(1)),
    "zero1": lambda: run_variant(deepspeed(1)),
    "zero2": lambda: run_variant(deepspeed(2)),
    "zero3": lambda: run_variant(deepspeed(3)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    for name, run in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        torch.save(run(), args.out / f"{name}_rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
