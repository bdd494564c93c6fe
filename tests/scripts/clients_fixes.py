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
- ``logging``: what ``accelerate.logging.get_logger``'s logger records on each process for ``main_process_only``,
  ``in_order``, ``warning_once`` (TRL's tokenizing calls it inside ``main_process_first``) and the level calls.
- ``main_only_save``: DDP training where only the main process calls ``save_state`` (and ``save_model``), as
  diffusers' training scripts do, then trains on (both processes must go on), then every process ``load_state``s
  the folder: the files written, the step counters and the weights after the load.
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


def logging_calls(lib: ModuleType) -> dict[str, Any]:
    import logging

    lib.Accelerator()  # (HF's PartialState() alone, after the reset between cases, would describe one process)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    name = "clients_fixes.logging"
    base = logging.getLogger(name)
    base.addHandler(handler)
    try:
        logger = importlib.import_module(f"{lib.__name__}.logging").get_logger(name, log_level="INFO")
        logger.info("main only")
        logger.info("everywhere", main_process_only=False)
        logger.warning("in order", in_order=True)
        with lib.PartialState().main_process_first():
            for _ in range(3):
                logger.warning_once("tokenizing once", main_process_only=False)
        logger.debug("below the level", main_process_only=False)
        logger.error("error %d", 7, main_process_only=False)
    finally:
        base.removeHandler(handler)
    return {
        "records": [(r.levelname, r.getMessage()) for r in records],
        "callers": sorted({r.funcName for r in records}),  # Accelerate's warning_once names itself
    }


def main_only_save(lib: ModuleType) -> dict[str, Any]:
    lib.utils.set_seed(0)
    accelerator = lib.Accelerator()
    model = torch.nn.Linear(4, 2)
    data = DataLoader(torch.arange(64.0).reshape(16, 4), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(accelerator.gather_for_metrics([scratch], use_gather_object=True)[0])  # rank 0's scratch
        for step, batch in enumerate(data):
            accelerator.backward(model(batch).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
                if accelerator.is_main_process:
                    accelerator.save_state(str(folder / "checkpoint-2"))
                    accelerator.save_model(model, str(folder / "model"))
            if step == 3:
                break
        accelerator.wait_for_everyone()
        record["files"] = sorted(p.name for p in (folder / "checkpoint-2").iterdir())
        record["model_files"] = sorted(p.name for p in (folder / "model").iterdir())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ours warns that random_states_1.pkl is missing; HF logs it at INFO
            accelerator.load_state(str(folder / "checkpoint-2"))
        loaded = accelerator.unwrap_model(model).state_dict()
        record["restored"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
        record["weights"] = [loaded[k].tolist() for k in sorted(loaded)]
        record["step"] = accelerator.step
        accelerator.wait_for_everyone()
    return record


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(3.0).unsqueeze(1))


CASES: dict[str, Callable[[ModuleType], dict[str, Any]]] = {
    "reset": reset,
    "own_folders": own_folders,
    "join_warning": join_warning,
    "join_iterable_warning": join_iterable_warning,
    "logging": logging_calls,
    "main_only_save": main_only_save,
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
