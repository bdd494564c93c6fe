"""What Accelerate's shipped test scripts found at 2 processes, under HF accelerate and under lightning_accel.

Launched under ``torch.distributed.run`` (2 CPU processes, ``ACCELERATE_USE_CPU=true`` so HF's state is multi-CPU).
For each framework and case it records what the case observes; each rank writes ``{framework}_rank{r}.pt``
(case -> record) for ``tests/launch/test_clients_fixes.py``, which wants the records of both frameworks equal.

- ``reset``: the process questions of an ``AcceleratorState`` after ``AcceleratorState._reset_state()``.
- ``own_folders``: ``save_state`` into a different folder on each process with a stateful loader, then
  ``load_state`` of that folder: the batches after the resume (each process resumes from its own folder).
- ``dataset_split``: ``split_between_processes`` of a ``datasets.Dataset``, with and without padding.
- ``join_warning``: ``join_uneven_inputs`` when the state says FSDP warns that it has no effect.
- ``join_iterable_warning``: ``join_uneven_inputs(even_batches=False)`` with an iterable loader prepared warns that
  the override is for map-style loaders only (HF accelerate does not join on CPU, so it warns about that instead).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest.mock import Mock

import torch
from torch.utils.data import DataLoader

from tests.helpers import reset_accelerator_states

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def reset(lib: ModuleType) -> dict[str, Any]:
    accelerator = lib.Accelerator()
    state = accelerator.state
    state._reset_state()
    record: dict[str, Any] = {
        name: getattr(state, name)
        for name in ("is_main_process", "is_local_main_process", "is_last_process", "use_distributed")
    }
    with state.split_between_processes(list(range(5))) as share:
        record["share"] = share
    with state.main_process_first():
        record["first"] = True
    state.wait_for_everyone()
    try:
        record["process_index"] = state.process_index
    except AttributeError as err:
        record["process_index"] = "AttributeError" if "_reset_state()" in str(err) else str(err)
    return record


def own_folders(lib: ModuleType) -> dict[str, Any]:
    accelerator = lib.Accelerator(dataloader_config=lib.DataLoaderConfiguration(use_stateful_dataloader=True))
    values = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    loader = accelerator.prepare(DataLoader(values, batch_size=4))
    unseen, resumed = [], []
    with tempfile.TemporaryDirectory() as folder:  # a different folder on each process
        for step, batch in enumerate(loader):
            if step == 2:
                accelerator.save_state(folder)
            if step > 2:
                unseen.append(batch.tolist())
        accelerator.load_state(folder)
        resumed = [batch.tolist() for batch in loader]
    return {"unseen": unseen, "resumed": resumed}


def dataset_split(lib: ModuleType) -> dict[str, Any]:
    from datasets import Dataset

    state = lib.Accelerator().state  # Accelerate's script splits with the AcceleratorState
    record: dict[str, Any] = {}
    for rows in (4, 3, 1):
        data = Dataset.from_list([{"k": k} for k in range(rows)])
        for padding in (False, True):
            with state.split_between_processes(data, apply_padding=padding) as share:
                record[f"{rows}-{padding}"] = (type(share).__name__, list(share["k"]))
    return record


def join_warning(lib: ModuleType) -> dict[str, Any]:
    accelerator = lib.Accelerator()
    original = accelerator.state.distributed_type
    accelerator.state.distributed_type = lib.DistributedType.FSDP
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with accelerator.join_uneven_inputs([Mock()]):
                pass
    finally:
        accelerator.state.distributed_type = original
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return {"warned": any("only supported for multi-GPU" in m for m in messages)}


def join_iterable_warning(lib: ModuleType) -> dict[str, Any]:
    accelerator = lib.Accelerator()
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    accelerator.prepare(DataLoader(Stream(), batch_size=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
    return {"messages": [str(w.message) for w in caught if issubclass(w.category, UserWarning)]}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(3.0).unsqueeze(1))


CASES: dict[str, Callable[[ModuleType], dict[str, Any]]] = {
    "reset": reset,
    "own_folders": own_folders,
    "join_warning": join_warning,
    "join_iterable_warning": join_iterable_warning,
}
if HAS_DATASETS:
    CASES["dataset_split"] = dataset_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for framework in ("accelerate", "lightning_accel"):
        lib = importlib.import_module(framework)
        records: dict[str, Any] = {}
        for name, case in CASES.items():
            reset_accelerator_states()
            records[name] = case(lib)
        reset_accelerator_states()
        torch.save(records, args.out / f"{framework}_rank{os.environ['RANK']}.pt")
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
