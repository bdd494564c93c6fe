"""Pipeline-parallel inference: ``prepare_pippy`` splits a model into one stage per process.

Accelerate's API on ``torch.distributed.pipelining``: the model is traced with example inputs, cut before each split
point (chosen from a balanced device map, or given as submodule names), and each process keeps its stage under a
``ScheduleGPipe`` schedule. The prepared model's ``forward`` feeds the micro-batches on the first process and returns
the output on the last (on every process with ``gather_output=True``). It needs several processes on one node (one
stage per local process); the collectives run on any backend with point-to-point sends, gloo on CPU included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module

from lightning_accel.state import PartialState
from lightning_accel.utils import (
    calculate_maximum_sizes,
    copy_tensor_to_devices,
    infer_auto_device_map,
    is_pippy_available,
    pad_input_tensors,
    send_to_device,
)
from lightning_accel.utils.other import convert_bytes

__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "pippy_forward", "prepare_pippy"]


def generate_device_map(
    model: Module,
    num_processes: int = 1,
    no_split_module_classes: list[str] | None = None,
    max_memory: dict[Any, Any] | None = None,
) -> dict[str, Any]:
    """A device map that spreads ``model`` evenly over ``num_processes`` devices (``0 .. num_processes - 1``).

    Without ``max_memory`` each device gets a tenth more than its share of the model (the shared parameters counted
    once), so the map balances the stages.
    """
    if num_processes == 1:
        return infer_auto_device_map(model, no_split_module_classes=no_split_module_classes, clean_result=False)
    if max_memory is None:
        total, largest = calculate_maximum_sizes(model)
        value, unit = convert_bytes((total + largest[0]) / num_processes).split(" ")
        share = f"{math.ceil(float(value)) * 1.1} {unit}"
        max_memory = dict.fromkeys(range(num_processes), share)
    return infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=no_split_module_classes, clean_result=False
    )


def _batch_size(value: Any) -> int | None:
    """The first dimension of the first tensor in ``value`` (nested lists, tuples, dicts), ``None`` if there is none."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _batch_size(item)
        if found is not None:
            return found
    return None


def find_pippy_batch_size(args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> int | None:
    """The batch size of the first tensor among ``args``, else among ``kwargs`` (``None`` if there is none)."""
    return _batch_size(list(args or ())) or _batch_size(dict(kwargs or {}))


def build_pipeline(model: Module, split_points: Sequence[str], args: Any, kwargs: Any, num_chunks: int) -> Any:
    """Trace ``model`` with the example inputs and cut it before each of ``split_points``.

    Returns this process's ``ScheduleGPipe``: stage ``local_process_index`` on its device, ``num_chunks`` micro-batches.
    """
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    state = PartialState()
    spec = dict.fromkeys(split_points, SplitPoint.BEGINNING)
    pipe = pipeline(model, mb_args=tuple(args or ()), mb_kwargs=kwargs, split_spec=spec)
    stage = pipe.build_stage(state.local_process_index, device=state.device)
    return ScheduleGPipe(stage, num_chunks)


def pippy_forward(forward: Callable[..., Any], num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any) -> Any:
    """Run one pipelined forward: the first process feeds the inputs, the last returns the output.

    The inputs are padded to a multiple of ``num_chunks`` (repeating the last sample) when their batch size differs.

    Raises:
        ValueError: If no input tensor gives the batch size on the first process.

    """
    state = PartialState()
    if state.num_processes == 1:
        return forward(*args, **kwargs)
    output = None
    if state.is_local_main_process:
        size = find_pippy_batch_size(args, kwargs)
        if size is None:
            raise ValueError("Could not find batch size from args or kwargs: pass the inputs as tensors.")
        if size != num_chunks:
            args = pad_input_tensors(args, size, num_chunks)
            kwargs = pad_input_tensors(kwargs, size, num_chunks)
        forward(*args, **kwargs)
    elif state.is_last_process:
        output = forward()
    else:
        forward()
    return copy_tensor_to_devices(output) if gather_output else output


def _auto_split_points(model: Module, num_chunks: int, no_split_module_classes: list[str] | None) -> list[str]:
    device_map = generate_device_map(model, num_chunks, no_split_module_classes=no_split_module_classes)
    points = []
    for index in range(1, num_chunks):
        first = next((name for name, device in device_map.items() if device == index), None)
        if first is None:
            raise ValueError(
                f"The balanced device map of {type(model).__name__} has no module on device {index} of {num_chunks}:"
                " pass split_points=[...] (submodule names) or fewer num_chunks."
            )
        points.append(first)
    return points


def prepare_pippy(
    model: Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple[Any, ...] | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> Module:
    """Split ``model`` for pipeline-parallel inference, one stage per process; returns it with a pipelined forward.

    Args:
        model: The model (on the CPU or the meta device; each process materializes its stage on its device).
        split_points: ``"auto"`` (a balanced cut from :func:`generate_device_map`) or the names of the submodules
            each later stage starts with.
        no_split_module_classes: Module classes a balanced cut keeps whole.
        example_args: Positional inputs of one process's batch, for tracing.
        example_kwargs: Keyword inputs of one batch, for tracing (every later call must use the same keys).
        num_chunks: Micro-batches per forward (default: the number of processes).
        gather_output: Send the last stage's output to every process.

    Raises:
        ImportError: Where torch has no ``torch.distributed.pipelining`` (torch < 2.4).
        ValueError: For ``split_points="auto"`` on the CPU (there are no devices to balance over), or if a balanced
            cut leaves a stage empty.

    """
    if not is_pippy_available():
        raise ImportError("prepare_pippy needs torch.distributed.pipelining, which comes with PyTorch 2.4.0 or later.")
    state = PartialState()
    example_args = send_to_device(example_args, "cpu")
    example_kwargs = send_to_device(example_kwargs, "cpu")
    chunks = state.num_processes if num_chunks is None else num_chunks
    if split_points == "auto":
        if state.device.type == "cpu":
            raise ValueError(
                "prepare_pippy(split_points='auto') balances the model over accelerator devices, and this run is on"
                " the CPU: pass split_points=[...], the names of the submodules each later stage starts with."
            )
        split_points = _auto_split_points(model, chunks, no_split_module_classes)
    points = [split_points] if isinstance(split_points, str) else list(split_points or [])
    schedule = build_pipeline(model, points, example_args, example_kwargs, chunks)
    original_forward = model.forward
    for name, value in {  # Accelerate's attributes
        "_original_forward": original_forward,
        "_original_call": model.__call__,
        "pippy_stage": schedule,
        "hf_split_points": points,
    }.items():
        object.__setattr__(model, name, value)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return pippy_forward(schedule.step, chunks, bool(gather_output), *args, **kwargs)

    forward.__wrapped__ = original_forward  # type: ignore[attr-defined]  # unwrap_model pops it
    model.forward = forward
    return model
