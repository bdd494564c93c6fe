"""Every data-loader configuration of Accelerate, run with HF accelerate's ``Accelerator`` and with lightning_accel's.

Launched once, with plain ``python`` (1 process) or under ``torch.distributed.run`` (2 CPU processes). For each case
below and each framework it prepares a model, an optimizer and a loader whose samples carry their dataset index,
then records per epoch the indices of every batch this process got, the ``end_of_dataloader`` flags, the remainder at
the last batch and ``len(loader)``; where every process gets as many batches it also trains (weights after two
epochs) and evaluates with ``gather_for_metrics``. Each rank writes ``{framework}_rank{r}.pt`` (case -> record) for
``tests/unit/accelerator/test_data.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from tests.helpers import reset_accelerator_states

EPOCHS = 2
HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(4, generator=g)
    return torch.tensor(index), x, x.sum(0, keepdim=True)


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return sample(index)


class ListIndexed(Indexed):
    """Indexed by lists of indices (the loader's sampler yields whole batches)."""

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        index, x, y = zip(*(sample(i) for i in indices), strict=True)
        return torch.stack(index), torch.stack(x), torch.stack(y)


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return (sample(i) for i in range(self.n))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


class Chunks:
    """A batch sampler that is not a torch ``BatchSampler``: chunks of 3, 2 and 4 indices, without ``batch_size``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _chunks(self) -> list[list[int]]:
        out, start, sizes = [], 0, [3, 2, 4]
        while start < self.n:
            size = sizes[len(out) % 3]
            out.append(list(range(start, min(start + size, self.n))))
            start += size
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._chunks())

    def __len__(self) -> int:
        return len(self._chunks())


class Shuffled:
    """A custom batch sampler with ``batch_size``: batches of a fixed permutation, the last one short."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n = n
        self.batch_size = batch_size
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self.order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size))

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


# name -> (loader factory, DataLoaderConfiguration kwargs, every process gets as many batches of one shape)
Case = tuple[Callable[[], DataLoader], dict[str, Any], bool]
CASES: dict[str, Case] = {
    "split": (lambda: DataLoader(Indexed(22), batch_size=4, shuffle=True), {"split_batches": True}, True),
    "split_seedable_drop_last": (
        lambda: DataLoader(Indexed(22), batch_size=4, shuffle=True, drop_last=True),
        {"split_batches": True, "use_seedable_sampler": True, "data_seed": 3},
        True,
    ),
    "split_uneven": (
        lambda: DataLoader(Indexed(22), batch_size=4),
        {"split_batches": True, "even_batches": False},
        False,
    ),
    "uneven_same_count": (lambda: DataLoader(Indexed(23), batch_size=3), {"even_batches": False}, False),
    "uneven_fewer_batches": (lambda: DataLoader(Indexed(20), batch_size=3), {"even_batches": False}, False),
    "custom_batch_sampler": (lambda: DataLoader(Indexed(17), batch_sampler=Chunks(17)), {}, False),
    "custom_batch_sampler_uneven": (
        lambda: DataLoader(Indexed(17), batch_sampler=Chunks(17)),
        {"even_batches": False},
        False,
    ),
    "custom_batch_sampler_split": (
        lambda: DataLoader(Indexed(18), batch_sampler=Shuffled(18, 4)),
        {"split_batches": True},
        True,
    ),
    "batch_sampler_as_sampler": (
        lambda: DataLoader(
            ListIndexed(13), sampler=BatchSampler(SequentialSampler(range(13)), 3, False), batch_size=None
        ),
        {},
        True,
    ),
    "iterable_dispatch_default": (lambda: DataLoader(SizedStream(22), batch_size=3), {}, True),
    "iterable_dispatch_padded": (lambda: DataLoader(Stream(21), batch_size=3), {}, True),
    "iterable_dispatch_split": (lambda: DataLoader(SizedStream(22), batch_size=4), {"split_batches": True}, True),
    "iterable_shard": (lambda: DataLoader(SizedStream(21), batch_size=2), {"dispatch_batches": False}, True),
    "iterable_shard_split_drop_last": (
        lambda: DataLoader(Stream(23), batch_size=4, drop_last=True),
        {"dispatch_batches": False, "split_batches": True},
        True,
    ),
    "map_dispatch_shuffled": (
        lambda: DataLoader(Indexed(23), batch_size=3, shuffle=True),
        {"dispatch_batches": True},
        True,
    ),
    "map_dispatch_split_drop_last": (
        lambda: DataLoader(Indexed(22), batch_size=4, drop_last=True),
        {"dispatch_batches": True, "split_batches": True},
        True,
    ),
}
if HAS_TORCHDATA:
    CASES["stateful"] = (
        lambda: DataLoader(Indexed(22), batch_size=2, shuffle=True),
        {"use_stateful_dataloader": True, "use_seedable_sampler": True, "data_seed": 9},
        True,
    )


def listing(accelerator: Any, loader: Any) -> dict[str, Any]:
    """Two epochs of batches (no collective besides the loader's own)."""
    epochs, ends, remainders = [], [], []
    for _ in range(EPOCHS):
        batches, flags = [], []
        for index, _, _ in loader:
            batches.append(index.tolist())
            flags.append(accelerator.gradient_state.end_of_dataloader)
            if flags[-1]:
                remainders.append(accelerator.gradient_state.remainder)
        epochs.append(batches)
        ends.append(flags)
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    return {"batches": epochs, "ends": ends, "remainders": remainders, "length": length}


def training(accelerator: Any, model: Any, optimizer: Any, loader: Any, tensors: bool) -> dict[str, Any]:
    """Two epochs of SGD, then one evaluation pass with gather_for_metrics."""
    for _ in range(EPOCHS):
        for _, x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    seen: list[int] = []
    with torch.no_grad():
        for index, _, _ in loader:
            if tensors:
                seen += accelerator.gather_for_metrics(index).tolist()
            else:
                seen += accelerator.gather_for_metrics(index.tolist(), use_gather_object=True)
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"weights": weights, "gathered": seen}


def stateful_resume(loader: Any) -> dict[str, Any]:
    """Stop after 3 batches, take the loader's state, load it and read the rest of the epoch."""
    for taken, _ in enumerate(loader, start=1):
        if taken == 3:
            break
    state = loader.state_dict()
    loader.load_state_dict(state)
    rest = [index.tolist() for index, _, _ in loader]
    return {"num_yielded": state.get("_num_yielded"), "finished": state.get("_iterator_finished"), "rest": rest}


def joined_training(accelerator: Any, model: Any, optimizer: Any, loader: Any) -> dict[str, Any]:
    """One epoch with uneven batch counts: processes that run out join instead of hanging."""
    with accelerator.join_uneven_inputs([model]):
        for _, x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"weights": weights}


def joined_run() -> dict[str, Any]:
    """lightning_accel only: HF accelerate 1.15's join_uneven_inputs does nothing on CPU processes (and hangs)."""
    import lightning_accel

    accelerator = lightning_accel.Accelerator(
        cpu=True, dataloader_config=lightning_accel.utils.DataLoaderConfiguration(even_batches=False)
    )
    torch.manual_seed(7)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(Indexed(20), batch_size=3))
    batches = [index.tolist() for index, _, _ in loader]
    record = joined_training(accelerator, model, optimizer, loader)
    accelerator.wait_for_everyone()
    return {"batches": batches, **record}


def run_case(accelerate: Any, case: Case) -> dict[str, Any]:
    factory, config, even = case
    loader_config = accelerate.utils.DataLoaderConfiguration(**config)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=loader_config)
    torch.manual_seed(7)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, factory())
    record = listing(accelerator, loader)
    if even:
        record.update(training(accelerator, model, optimizer, loader, tensors=True))
    elif _same_counts(record):
        record.update(training(accelerator, model, optimizer, loader, tensors=False))
    if config.get("use_stateful_dataloader"):
        record["resume"] = stateful_resume(loader)
    record["type"] = type(loader).__name__
    accelerator.wait_for_everyone()
    return record


def _same_counts(record: dict[str, Any]) -> bool:
    if not torch.distributed.is_initialized():
        return True
    counts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, len(record["batches"][0]))
    return len(set(counts)) == 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out: Path = parser.parse_args().out
    rank = int(os.environ.get("RANK", "0"))

    import accelerate

    import lightning_accel

    for name, module in (("hf", accelerate), ("ours", lightning_accel)):
        records = {}
        for case_name, case in CASES.items():
            if case_name == "batch_sampler_as_sampler" and "WORLD_SIZE" not in os.environ:
                continue  # HF accelerate 1.15 passes batch_size twice for it on one process (TypeError)
            reset_accelerator_states()
            records[case_name] = run_case(module, case)
        torch.save(records, out / f"{name}_rank{rank}.pt")
    reset_accelerator_states()
    torch.save(joined_run(), out / f"join_rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
