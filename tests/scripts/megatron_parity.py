"""``acc_megatron_lm`` on CPU processes (gloo): a small megatron-core GPT trained for a few steps.

Run under ``torch.distributed.run``. With 1 process it trains the references (``tp1``: tp=1, gradient clipping on,
checkpointed; ``tp1_noclip``: clipping off; ``tp1_resumed``: on from ``tp1``'s checkpoint); with 2 processes ``tp2``
(Trainer, tp=2, checkpointed), ``fabric_tp2`` (Fabric, then saved and loaded), ``fabric_tp2_clip_gradients`` (Fabric,
clipped by ``fabric.clip_gradients`` instead of the plugin), ``dp2`` (Trainer, tp=1 and data parallelism 2),
``accelerator_tp2`` (the Accelerator shim), and from ``tp2``'s checkpoint ``tp2_resumed`` (tp=2) and ``dp2_from_tp2``
(tp=1). Every run sees the same global batches and starts from the same weights. Each rank saves
``{variant}_rank{r}.pt`` with the global loss of every step, the full (tensor-parallel shards gathered) weights after
training, and what the strategy reported.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers the strategy names)
from lightning_accel.strategies.megatron import AcceleratedMegatronLMStrategy, FabricAcceleratedMegatronLMStrategy
from lightning_accel.strategies.megatron_gpt import gpt_model
from lightning_accel.utils import MegatronLMPlugin

SEQ, VOCAB, GLOBAL_BATCH, SAMPLES, STEPS, LR = 8, 32, 4, 16, 4, 0.5
CLIP = 0.05  # small enough that every step clips
COMMON: dict[str, Any] = {"context_parallel_size": 1, "use_rotary_position_embeddings": False}  # rope needs CUDA


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    return TensorDataset(ids, labels)


def build(plugin: MegatronLMPlugin, cpu_attention: bool | None = None) -> nn.Module:
    torch.manual_seed(1234)  # the same full weights on every rank and for every tp_degree
    sizes = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4}
    return gpt_model(plugin, vocab_size=VOCAB, max_sequence_length=SEQ, cpu_attention=cpu_attention, **sizes)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # momentum: optimizer state the checkpoints must carry


def loss_of(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    causal = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).triu(1)  # True: masked
    return model(ids, positions, causal, labels=labels).mean()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight made whole: tensor-parallel shards gathered over megatron's tensor-parallel group."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    whole = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            tensor = torch.cat(parts, dim=param.partition_dim)
        whole[name] = tensor.detach().cpu().clone()
    return whole


def global_loss(loss: torch.Tensor) -> float:
    from megatron.core import parallel_state

    value = loss.detach().clone()
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return float(value) / parallel_state.get_data_parallel_world_size()


def report(strategy: Any, model: nn.Module) -> dict[str, Any]:
    from megatron.core import parallel_state

    attention = type(model.get_submodule("decoder.layers.0.self_attention.core_attention")).__name__
    return {
        "distributed_type": str(strategy.distributed_type),
        "sampler": dict(strategy.distributed_sampler_kwargs),
        "tp": (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()),
        "dp": (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()),
        "core_attention": attention,
        "qkv_shape": tuple(model.get_parameter("decoder.layers.0.self_attention.linear_qkv.weight").shape),
    }


class GPTModule(L.LightningModule):
    def __init__(self, plugin: MegatronLMPlugin, cpu_attention: bool | None = None) -> None:
        super().__init__()
        self.plugin = plugin
        self.cpu_attention = cpu_attention
        self.gpt: nn.Module | None = None
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = build(self.plugin, self.cpu_attention)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.gpt is not None
        loss = loss_of(self.gpt, batch)
        self.losses.append(global_loss(loss))
        return loss

    def on_train_end(self) -> None:  # before the strategy's teardown destroys megatron's parallel state
        assert self.gpt is not None
        self.result = {"weights": full_weights(self.gpt), **report(self.trainer.strategy, self.gpt)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters())


def run_trainer(
    plugin: MegatronLMPlugin,
    world: int,
    accelerator: str = "cpu",
    cpu_attention: bool | None = None,
    *,
    steps: int = STEPS,
    save_to: Path | None = None,
    resume: Path | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps (an epoch is ``STEPS``); ``save_to`` checkpoints each epoch, ``resume`` starts there."""
    strategy = AcceleratedMegatronLMStrategy(plugin)
    module = GPTModule(plugin, accelerator == "cpu" if cpu_attention is None else cpu_attention)
    saving = [] if save_to is None else [ModelCheckpoint(dirpath=save_to, filename="last", save_top_k=1)]
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_to is not None,
        callbacks=saving,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dp = world // plugin.tp_degree
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp), ckpt_path=resume)
    return {"losses": module.losses, **module.result}


def run_fabric(
    plugin: MegatronLMPlugin,
    world: int,
    clip_by_call: float = 0.0,
    checkpoint: Path | None = None,
    strategy: FabricAcceleratedMegatronLMStrategy | None = None,
) -> dict[str, Any]:
    """Fabric's loop; ``clip_by_call`` > 0 clips with ``fabric.clip_gradients`` instead of the plugin.

    With ``checkpoint``, the trained model and optimizer are saved there with ``fabric.save`` and loaded into a fresh
    model and optimizer with ``fabric.load``. ``strategy`` replaces the one built from ``plugin``.
    """
    strategy = strategy or FabricAcceleratedMegatronLMStrategy(plugin)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = build(plugin, cpu_attention=True)
    wrapped, opt = fabric.setup(model, optimizer(model.parameters()))
    dp = world // plugin.tp_degree
    # shuffle=True: Fabric's DistributedSampler then shuffles with seed 0, as the Trainer's always does for training
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp, shuffle=True))
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        loss = loss_of(wrapped, batch)
        fabric.backward(loss)
        if clip_by_call:
            fabric.clip_gradients(wrapped, opt, max_norm=clip_by_call)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss))
    result = {"losses": losses, "weights": full_weights(model), **report(strategy, model)}
    if checkpoint is not None:
        result.update(save_and_load(fabric, plugin, checkpoint, wrapped, opt))
    strategy.teardown()
    return result


def save_and_load(fabric: L.Fabric, plugin: MegatronLMPlugin, path: Path, model: Any, opt: Any) -> dict[str, Any]:
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})
    fresh = build(plugin, cpu_attention=True)
    fresh_model, fresh_opt = fabric.setup(fresh, optimizer(fresh.parameters()))
    restored: dict[str, Any] = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
    fabric.load(path, restored)
    ours, theirs = opt.state_dict()["state"], fresh_opt.state_dict()["state"]  # this rank's shards
    momentum = [float((ours[i]["momentum_buffer"] - theirs[i]["momentum_buffer"]).abs().max()) for i in ours]
    return {"restored_step": restored["step"], "restored_weights": full_weights(fresh), "momentum_diffs": momentum}


def run_accelerator(plugin: MegatronLMPlugin) -> dict[str, Any]:
    """The Accelerate-compatible shim: ``prepare(model, optimizer)``, ``backward``, ``step``.

    The data loader is not prepared: the shim shards loaders over all processes, while tensor-parallel ranks must
    read the same batch. It is built with the strategy's sampler arguments and the Trainer's shuffling instead.
    """
    from torch.utils.data import DistributedSampler

    from lightning_accel import Accelerator

    accelerator = Accelerator(cpu=True, megatron_lm_plugin=plugin)
    strategy = accelerator.fabric.strategy  # the shim runs on a Fabric
    model = build(plugin, cpu_attention=True)
    prepared, opt = accelerator.prepare(model, optimizer(model.parameters()))
    sampler = DistributedSampler(dataset(), shuffle=True, seed=0, **strategy.distributed_sampler_kwargs)
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        loss = loss_of(prepared, batch)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss))
    shim_loader = accelerator.prepare(DataLoader(torch.arange(8), batch_size=2))  # what the shim would feed
    result = {"losses": losses, "weights": full_weights(model), **report(strategy, model)}
    result["prepared_batches"] = [batch.tolist() for batch in shim_loader]
    strategy.teardown()  # megatron's parallel state goes with it
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    clipped = MegatronLMPlugin(**COMMON, gradient_clipping=CLIP)
    if world == 1:
        checkpoints = args.out / "tp1_checkpoints"
        variants = {
            "tp1": lambda: run_trainer(clipped, 1, save_to=checkpoints),
            "tp1_noclip": lambda: run_trainer(MegatronLMPlugin(**COMMON, gradient_clipping=0), 1),
            "tp1_resumed": lambda: run_trainer(clipped, 1, steps=2 * STEPS, resume=checkpoints / "last.ckpt"),
        }
    else:
        tp2 = MegatronLMPlugin(tp_degree=2, **COMMON, gradient_clipping=CLIP)
        checkpoints = args.out / "tp2_checkpoints"
        variants = {
            "tp2": lambda: run_trainer(tp2, 2, save_to=checkpoints),
            "fabric_tp2": lambda: run_fabric(tp2, 2, checkpoint=args.out / "fabric_tp2.ckpt"),
            "fabric_tp2_clip_gradients": lambda: run_fabric(
                MegatronLMPlugin(tp_degree=2, **COMMON, gradient_clipping=0), 2, clip_by_call=CLIP
            ),
            "dp2": lambda: run_trainer(clipped, 2),
            "accelerator_tp2": lambda: run_accelerator(tp2),
            # the second epoch from tp2's checkpoint: at tp_degree=2, and at tp_degree=1 (data parallelism 2)
            "tp2_resumed": lambda: run_trainer(tp2, 2, steps=2 * STEPS, resume=checkpoints / "last.ckpt"),
            "dp2_from_tp2": lambda: run_trainer(clipped, 2, steps=2 * STEPS, resume=checkpoints / "last.ckpt"),
        }
    for name, run in variants.items():
        torch.save(run(), args.out / f"{name}_rank{rank}.pt")
        dist.barrier()


if __name__ == "__main__":
    main()
