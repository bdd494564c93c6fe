"""Accelerate's memory arithmetic for big-model inference: byte sizes of dtypes and modules, and per-device budgets.

Budgets (``max_memory``) are keyed like Accelerate's: ``int`` accelerator indices first, then ``"mps"``, ``"cpu"`` and
``"disk"``. Integer keys are only numbers here, so a device map can be planned for a machine other than this one.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

from lightning_accel.enums import CustomDtype
from lightning_accel.utils.modeling.tensors import named_module_tensors

__all__ = [
    "DtypeLike",
    "MaxMemory",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "get_module_leaves",
]

logger = logging.getLogger(__name__)

DtypeLike: TypeAlias = str | torch.dtype
MaxMemory: TypeAlias = dict[int | str, Any]

_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
_ONE_BYTE_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_HOST_DEVICES = ("mps", "cpu", "disk")


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in a size given as an ``int`` or a string with a unit: ``"5GB"``, ``"1.5GiB"``, ``"100KB"``, ``"8Mb"``.

    Decimal units (KB, MB, GB) are powers of 10 and binary ones (KiB, MiB, GiB) powers of 2; a lower-case ``b``
    (``"8Mb"``) counts bits.

    Raises:
        ValueError: For a negative size or text that is not a number followed by one of those units.

    """
    error = ValueError(
        f"`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit (like '5.0GB')."
    )
    if isinstance(size, int):
        if size < 0:
            raise error
        return size
    for unit, factor in _UNITS.items():
        if size.upper().endswith(unit):
            try:
                number = float(size[: -len(unit)])
            except ValueError:
                raise error from None
            if number < 0:
                raise error
            result = int(number * factor)
            return result // 8 if not unit.endswith("IB") and size.endswith("b") else result
    raise error


def _as_dtype(dtype: DtypeLike) -> torch.dtype:
    """``torch.float16`` for ``"float16"`` or ``"torch.float16"``; a dtype is returned as is."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{dtype!r} is not a torch dtype; pass e.g. 'float16' or torch.float16.")
        return resolved
    return dtype


def dtype_byte_size(dtype: torch.dtype | CustomDtype) -> float:
    """Bytes per element of ``dtype`` (``1/8`` for bool, fractions for Accelerate's 2- and 4-bit dtypes).

    Raises:
        ValueError: For a dtype whose name does not end in its bit width.

    """
    if dtype == torch.bool:
        return 1 / 8
    if isinstance(dtype, CustomDtype):
        return {CustomDtype.INT2: 1 / 4, CustomDtype.INT4: 1 / 2, CustomDtype.FP8: 1}[dtype]
    if str(dtype).removeprefix("torch.") in _ONE_BYTE_FLOAT8:
        return 1
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(bits.group(1)) // 8


def compute_module_sizes(
    model: nn.Module,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes of every module and tensor of ``model``, keyed by name (``""`` is the whole model).

    Args:
        model: The model (it may be on the meta device: only shapes and dtypes are read).
        dtype: The dtype floating-point weights will be loaded in; a tensor already smaller keeps its size and
            integer tensors are never converted.
        special_dtypes: Per-tensor dtypes overriding ``dtype``.
        buffers_only: Count the buffers only.

    """
    default_size = dtype_byte_size(_as_dtype(dtype)) if dtype is not None else None
    special_sizes = {name: dtype_byte_size(_as_dtype(d)) for name, d in (special_dtypes or {}).items()}
    tensors: Iterable[tuple[str, torch.Tensor]] = (
        model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    )
    sizes: defaultdict[str, int] = defaultdict(int)
    for name, tensor in tensors:
        own_size = dtype_byte_size(tensor.dtype)
        if name in special_sizes:
            element_size = special_sizes[name]
        elif default_size is None or str(tensor.dtype).startswith(("torch.uint", "torch.int", "torch.bool")):
            element_size = own_size
        else:
            element_size = min(default_size, own_size)
        size = tensor.numel() * element_size
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size  # type: ignore[assignment]
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module, dtype: DtypeLike | None = None, special_dtypes: Mapping[str, DtypeLike] | None = None
) -> int:
    """Bytes of all of ``model``'s buffers (sized as :func:`compute_module_sizes` would)."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_max_layer_size(
    modules: Sequence[tuple[str, Any]], module_sizes: Mapping[str, int], no_split_module_classes: Sequence[str]
) -> tuple[int, list[str]]:
    """The largest layer among ``modules`` and the names of the layers of that size.

    A layer is a module without children, a module whose class is in ``no_split_module_classes``, or a bare
    parameter or buffer.

    Args:
        modules: Named modules (or tensors) to search, descended into until layers are reached.
        module_sizes: Sizes from :func:`compute_module_sizes`.
        no_split_module_classes: Class names of modules kept whole.

    """
    max_size = 0
    layer_names: list[str] = []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending = [(f"{name}.{child_name}", child) for child_name, child in children] + pending
            continue
        size = module_sizes[name]
        if size > max_size:
            max_size, layer_names = size, [name]
        elif size == max_size:
            layer_names.append(name)
    return max_size, layer_names


def _available_host_memory() -> int:
    """Bytes of RAM available to this process (psutil's ``available``; Linux's ``MemAvailable`` without psutil)."""
    try:
        import psutil
    except ImportError:
        if not os.path.isfile("/proc/meminfo"):
            raise ImportError(
                "Measuring the available RAM needs psutil on this system: `pip install psutil`, or pass max_memory."
            ) from None
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    return int(psutil.virtual_memory().available)


def _accelerator_type() -> str | None:
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else None


def _accelerator_free_memory() -> tuple[dict[int | str, int], bool]:
    """Free bytes on each accelerator device by index, and whether one shares the host's memory (integrated GPU)."""
    kind = _accelerator_type()
    if kind is None or kind == "mps":
        return {}, False
    backend = getattr(torch, kind)
    free: dict[int | str, int] = {}
    integrated = False
    for index in range(torch.accelerator.device_count()):
        try:
            torch.zeros(1, device=torch.device(kind, index))  # initialise the device so its memory info is right
            free[index] = int(backend.mem_get_info(index)[0])
        except (RuntimeError, AttributeError) as error:
            logger.info(f"Device {kind}:{index} seems unavailable ({error}); proceeding to check subsequent devices.")
            continue
        if kind == "cuda":
            integrated = integrated or bool(getattr(torch.cuda.get_device_properties(index), "is_integrated", False))
    return free, integrated


def get_max_memory(max_memory: Mapping[int | str, int | str] | None = None) -> MaxMemory:
    """A memory budget per device, in bytes, accelerators first, then ``mps``, ``cpu``, ``disk``.

    Without ``max_memory``, the free memory of every accelerator and the available RAM; otherwise ``max_memory``
    with size strings converted to bytes (an index torch does not see is kept, with a warning).

    Raises:
        ValueError: For a key that is not an ``int``, ``"mps"``, ``"cpu"`` or ``"disk"``.

    """
    if max_memory is None:
        budget, integrated = _accelerator_free_memory()
        # MPS and integrated GPUs share host RAM: a separate CPU budget would count it twice.
        if _accelerator_type() == "mps":
            budget["mps"] = _available_host_memory()
        elif not integrated:
            budget["cpu"] = _available_host_memory()
        return budget

    unknown = [key for key in max_memory if not isinstance(key, int) and key not in _HOST_DEVICES]
    if unknown:
        raise ValueError(
            f"Device {unknown[0]} is not recognized, available devices are integers(for GPU/XPU), 'mps', 'cpu' and "
            "'disk'"
        )
    indices = sorted(key for key in max_memory if isinstance(key, int))
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    for index in indices:
        if not 0 <= index < count:
            logger.warning(f"Device {index} is not available, available devices are {list(range(count))}")
    ordered: list[int | str] = [*indices, *(key for key in _HOST_DEVICES if key in max_memory)]
    return {
        key: convert_file_size_to_int(max_memory[key]) if isinstance(max_memory[key], str) else max_memory[key]
        for key in ordered
    }


def get_module_leaves(module_sizes: Mapping[str, int]) -> list[str]:
    """The names in ``module_sizes`` that have no child in it (the whole model ``""`` excluded)."""
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if "." in name}
    return [name for name in module_sizes if name and name not in parents]


def _no_split_names(no_split_module_classes: str | Iterable[str] | None) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def _checked_no_split_names(model: nn.Module, no_split_module_classes: str | Iterable[str] | None) -> list[str]:
    """``no_split_module_classes`` as a list of class names, each the name of a class ``model`` has a module of.

    Raises:
        TypeError: If an entry is not a string (a class object is never matched: pass its ``__name__``).
        ValueError: If a name matches no module of ``model`` (a typo, or a class of another model), naming the
            classes the model has.

    """
    names = _no_split_names(no_split_module_classes)
    wrong_type = [name for name in names if not isinstance(name, str)]
    if wrong_type:
        raise TypeError(
            f"no_split_module_classes must hold class names (strings), got {wrong_type!r}; pass e.g. "
            f"[{', '.join(repr(getattr(c, '__name__', str(c))) for c in wrong_type)}]"
        )
    present = {type(module).__name__ for module in model.modules()}
    absent = [name for name in names if name not in present]
    if absent:
        raise ValueError(
            f"no_split_module_classes names {absent}, which the model ({type(model).__name__}) has no module of, "
            f"so nothing would be kept whole; the model's module classes are {sorted(present)}. Fix the spelling "
            "or remove the name"
        )
    return names


def _largest_no_split_block(model: nn.Module, module_sizes: Mapping[str, int], no_split: Sequence[str]) -> int:
    """The largest size among the first module met of each no-split class (0 without such modules)."""
    block_sizes: dict[str, int] = {}
    for name, size in module_sizes.items():
        if not no_split or set(block_sizes) == set(no_split):
            break
        try:
            class_name = type(model.get_submodule(name)).__name__ if name else ""
        except AttributeError:  # a parameter or buffer
            continue
        if class_name in no_split:
            block_sizes.setdefault(class_name, size)
    return max(block_sizes.values(), default=0)


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: str | Iterable[str] | None = None,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    low_zero: bool = False,
) -> MaxMemory:
    """A ``max_memory`` for :func:`infer_auto_device_map` that spreads the model evenly over the accelerators.

    Each accelerator but the last gets the model's size divided by their number, plus room for the largest
    no-split block (or the mean leaf module, if larger) times 1.25; the last keeps its full budget.

    Args:
        model: The model (may be on the meta device).
        max_memory: Budgets per device (defaults to the free memory of each).
        no_split_module_classes: Class names of modules never split across devices.
        dtype: The dtype the weights will be loaded in.
        special_dtypes: Per-tensor dtypes overriding ``dtype``.
        low_zero: Put as little as possible on accelerator 0 (kept free for e.g. generation).

    """
    no_split = _checked_no_split_names(model, no_split_module_classes)
    user_set_budget = max_memory is not None
    budget = get_max_memory(max_memory)
    on_mps = _accelerator_type() == "mps"
    devices = [key for key in budget if (isinstance(key, int) or (on_mps and key == "mps")) and budget[key] > 0]
    if not devices:
        return budget
    if len(devices) == 1:
        low_zero = False
        if not user_set_budget:
            first = next((key for key in budget if isinstance(key, int)), None)
            if first is not None:
                budget[first] *= 0.9
                logger.info(
                    f"We will use 90% of the memory on device {first} for storing the model, and 10% for the buffer "
                    "to avoid OOM. You can set `max_memory` in to a higher value to use more memory (at your own risk)."
                )

    module_sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_device = module_sizes[""] // (len(devices) - 1 if low_zero else len(devices))
    block = _largest_no_split_block(model, module_sizes, no_split)
    # Leaves of the sizes are tensors; once they are dropped, the leaves are the innermost modules.
    tensor_leaves = set(get_module_leaves(module_sizes))
    module_only = {name: size for name, size in module_sizes.items() if name not in tensor_leaves}
    leaves = get_module_leaves(module_only)
    mean_leaf = int(sum(module_only[name] for name in leaves) / max(len(leaves), 1))
    per_device += int(1.25 * max(block, mean_leaf))

    indices = sorted(key for key, size in budget.items() if isinstance(key, int) and size > 0)
    for index in indices[:-1]:
        budget[index] = min(budget[0] if low_zero and index == 0 else per_device, budget[index])
    if low_zero:
        rest = sum(budget[index] for index in range(1, len(devices)))
        budget[0] = min(max(0, module_sizes[""] - rest), budget[0])
    return budget


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """The model's total size and its largest layer (size and names), using transformers' ``_no_split_modules``."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top_level = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(top_level, sizes, no_split)
