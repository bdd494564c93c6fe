"""Two CPU processes: LocalSGD, profile traces, tensor parallelism and prepare_pippy, ours next to HF accelerate's.

Launched under ``torch.distributed.run`` with 2 processes. Each phase writes ``{phase}_rank{r}.pt`` for
``tests/launch/test_accelerator_parallel.py``:

- ``local_sgd``: DDP, then LocalSGD with ``local_sgd_steps`` 1 and 3, for lightning_accel and HF accelerate (weights);
- ``profile``: the trace files each framework's ``profile()`` wrote;
- ``tp``: ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2))`` with the plan on the model (``tp_plan``)
  and with ``parallelize_module`` before ``prepare``, against one process on the same batches (losses, weights, the
  batches each rank saw, the rank members);
- ``pippy``: ``prepare_pippy`` outputs of both frameworks and of the plain model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import reset_accelerator_states

STEPS = 6
LR = 0.1


def data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 4, generator=g))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_local_sgd(accelerate: Any, local_sgd_module: Any, steps: int | None) -> dict[str, torch.Tensor]:
    """Train with DDP (``steps=None``) or LocalSGD averaging every ``steps`` optimizer steps."""
    reset_accelerator_states()
    accelerator = accelerate.Accelerator(cpu=True)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data(), batch_size=4))
    if steps is None:
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    else:
        with local_sgd_module.LocalSGD(accelerator, model, local_sgd_steps=steps) as local_sgd:
            for x, y in loader:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
    return weights(accelerator.unwrap_model(model))


def local_sgd_phase() -> dict[str, Any]:
    import accelerate
    import accelerate.local_sgd

    import lightning_accel
    import lightning_accel.local_sgd

    result: dict[str, Any] = {}
    for name, module, sgd in (
        ("ours", lightning_accel, lightning_accel.local_sgd),
        ("hf", accelerate, accelerate.local_sgd),
    ):
        result[f"{name}_ddp"] = train_local_sgd(module, sgd, None)
        for steps in (1, 3):
            result[f"{name}_k{steps}"] = train_local_sgd(module, sgd, steps)
    return result


def profile_phase(out: Path) -> dict[str, Any]:
    import accelerate

    import lightning_accel

    found = {}
    for name, module in (("ours", lightning_accel), ("hf", accelerate)):
        reset_accelerator_states()
        trace_dir = out / f"traces_{name}"
        handler = module.utils.ProfileKwargs(output_trace_dir=str(trace_dir))
        accelerator = module.Accelerator(cpu=True, kwargs_handlers=[handler])
        with accelerator.profile() as prof:
            torch.mm(torch.randn(8, 8), torch.randn(8, 8))
        names = {event.key for event in prof.key_averages()}
        found[name] = {"files": sorted(p.name for p in trace_dir.iterdir()), "has_mm": "aten::mm" in names}
    return found


def reference_tp(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": weights(model)}


def train_tp(plan_on_model: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import lightning_accel
    from lightning_accel.utils import ParallelismConfig

    reset_accelerator_states()
    accelerator = lightning_accel.Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    model = MLP()
    if plan_on_model:
        model.tp_plan = {"w1": "colwise", "w2": RowwiseParallel()}  # type: ignore[assignment]  # read by prepare
    else:
        assert accelerator.torch_device_mesh is not None
        parallelize_module(
            model, accelerator.torch_device_mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(data(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, batches = [], []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        batches.append((x.clone(), y.clone()))
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    mesh = accelerator.torch_device_mesh
    return {
        "losses": losses,
        "weights": full,
        "batches": batches,
        "reference": reference_tp(batches),
        "split": isinstance(accelerator.unwrap_model(model).get_parameter("w1.weight"), DTensor),
        "tensor_parallel_rank": accelerator.tensor_parallel_rank,
        "data_parallel_rank": accelerator.data_parallel_rank,
        "data_parallel_shard_rank": accelerator.data_parallel_shard_rank,
        "mesh_dims": tuple(mesh.mesh_dim_names or ()) if mesh is not None else None,
        "distributed_type": str(accelerator.distributed_type),
        "is_fsdp2": accelerator.is_fsdp2,
        "should_save_model": accelerator.should_save_model,
        "loader_batches": len(loader),
    }


def pippy_phase() -> dict[str, Any]:
    import accelerate
    import accelerate.inference

    import lightning_accel.inference

    found: dict[str, Any] = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    found["plain"] = MLP()(x).detach()
    # HF accelerate's gather_output fails on CPU (copy_tensor_to_devices passes a tensor shape to torch.zeros), so its
    # output is read on the last process only; ours is gathered to every process, and read without gathering too.
    cases: tuple[tuple[str, Any, Any, bool], ...] = (
        ("ours", lightning_accel, lightning_accel.inference, True),
        ("ours_last", lightning_accel, lightning_accel.inference, False),
        ("hf_last", accelerate, accelerate.inference, False),
    )
    for name, module, inference, gather in cases:
        reset_accelerator_states()
        module.PartialState(cpu=True)
        model = inference.prepare_pippy(MLP(), split_points=["w2"], example_args=(x[:2],), gather_output=gather)
        with torch.no_grad():
            output = model(x)
        found[name] = None if output is None else output.detach().clone()
        found[f"{name}_split_points"] = model.hf_split_points
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phases", nargs="*", default=None)
    options = parser.parse_args()
    out = options.out
    import torch.distributed as dist

    phases = {
        "local_sgd": local_sgd_phase,
        "profile": lambda: profile_phase(out),
        "tp": lambda: {"model_plan": train_tp(True), "parallelize_first": train_tp(False)},
        "pippy": pippy_phase,
    }
    for phase, run in phases.items():
        if options.phases is not None and phase not in options.phases:
            continue
        result = run()
        rank = dist.get_rank()
        torch.save(result, out / f"{phase}_rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
