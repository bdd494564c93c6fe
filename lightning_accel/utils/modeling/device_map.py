"""Accelerate's device maps: which device (accelerator index, ``"cpu"`` or ``"disk"``) each submodule goes to.

:func:`infer_auto_device_map` plans the placement Accelerate plans, module by module in definition order: fill the
accelerators in order, then the CPU, then the disk, splitting a module into its children when it does not fit
(unless its class is a no-split block) and keeping tied weights together. On the first accelerator and the CPU, room
for the largest remaining layer stays free, since an offloaded layer is brought there to run.

Two differences from Accelerate 1.15, both where its maps are wrong: a tied weight is "inside" a module only when
its name starts with the module's name (Accelerate tests substring containment, so module ``"0"`` also claimed
``"1.0.weight"``), and the direct buffers of a module that is split follow its first child (Accelerate left them
out, so when the children landed on different devices :func:`check_device_map` refused Accelerate's own map).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import nn

from lightning_accel.utils.modeling.sizes import (
    DtypeLike,
    _checked_no_split_names,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
)
from lightning_accel.utils.modeling.tensors import DeviceLike, check_tied_parameters_in_config, find_tied_parameters

__all__ = [
    "check_device_map",
    "clean_device_map",
    "fallback_allocate",
    "get_module_size_with_ties",
    "infer_auto_device_map",
]

logger = logging.getLogger(__name__)

NamedItem = tuple[str, Any]  # a submodule, parameter or buffer still to place, by name

# The strategies a ``device_map`` string may name (Accelerate's).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _inside(name: str, tensor_name: str) -> bool:
    return tensor_name == name or tensor_name.startswith(name + ".")


def _children(name: str, module: Any) -> list[NamedItem]:
    """What a split of ``module`` puts in its place: its direct parameters and submodules, by full name."""
    items = [*module.named_parameters(recurse=False), *module.named_children()]
    return [(f"{name}.{child}", value) for child, value in items]


def _splittable(module: Any, no_split: Sequence[str]) -> bool:
    return isinstance(module, nn.Module) and bool(list(module.children())) and type(module).__name__ not in no_split


def _outside_ties(name: str, tied_parameters: Sequence[Sequence[str]]) -> list[str]:
    """The tied parameters outside ``name`` whose group has a member inside it."""
    outside: list[str] = []
    for group in tied_parameters:
        inner = [_inside(name, tensor) for tensor in group]
        if any(inner) and not all(inner):
            outside.extend(tensor for tensor, is_inner in zip(group, inner, strict=True) if not is_inner)
    return outside


def get_module_size_with_ties(
    tied_params: Sequence[str], module_size: int, module_sizes: Mapping[str, int], modules_to_treat: Sequence[NamedItem]
) -> tuple[int, list[str], list[Any]]:
    """The size of a module together with the pending modules holding the parameters tied to it.

    Args:
        tied_params: Parameters outside the module tied to parameters inside it.
        module_size: The module's own size.
        module_sizes: Sizes from :func:`compute_module_sizes`.
        modules_to_treat: The modules not placed yet; a tied parameter counts with the one holding it.

    Returns:
        The total size (a tied parameter itself counted once), the names of the holding modules and the modules.

    """
    total = module_size
    names: list[str] = []
    modules: list[Any] = []
    for tied in tied_params:
        holder = next(((n, m) for n, m in modules_to_treat if _inside(n, tied)), None)
        if holder is None:  # already placed with another member of its group
            continue
        names.append(holder[0])
        modules.append(holder[1])
        total += module_sizes[holder[0]] - module_sizes[tied]
    return total, names, modules


def _limit(size_limit: int | float | str) -> float | None:
    if isinstance(size_limit, str):
        try:
            return convert_file_size_to_int(size_limit)
        except ValueError:
            return None
    return size_limit if size_limit >= 0 else None


def fallback_allocate(
    modules: list[NamedItem],
    module_sizes: Mapping[str, int],
    size_limit: int | float | str,
    no_split_module_classes: Sequence[str] | None = None,
    tied_parameters: Sequence[Sequence[str]] | None = None,
) -> tuple[str | None, Any, list[NamedItem]]:
    """Find, breadth-first, a module (or submodule) of ``modules`` that fits in ``size_limit``.

    Args:
        modules: The modules not placed yet.
        module_sizes: Sizes from :func:`compute_module_sizes`.
        size_limit: The room left, in bytes (or a size string).
        no_split_module_classes: Class names of modules never split.
        tied_parameters: Groups of tied parameter names.

    Returns:
        The name and module found (``None, None`` if none fits) and the modules left, with the found one's ancestors
        replaced by their children.

    """
    limit = _limit(size_limit)
    if limit is None:
        return None, None, modules
    no_split = list(no_split_module_classes or [])
    ties = list(tied_parameters or [])
    search = list(modules)
    found: str | None = None
    while search:
        name, module = search.pop(0)
        size, _, _ = get_module_size_with_ties(_outside_ties(name, ties), module_sizes[name], module_sizes, search)
        if size <= limit:
            found = name
            break
        if _splittable(module, no_split):
            search = _children(name, module) + search
    if found is None:
        return None, None, modules

    remaining = list(modules)
    for end in (i for i, char in enumerate(found) if char == "."):
        names = [n for n, _ in remaining]
        if found[:end] in names:
            index = names.index(found[:end])
            remaining[index : index + 1] = _children(*remaining[index])
    index = [n for n, _ in remaining].index(found)
    name, module = remaining.pop(index)
    return name, module, remaining


class _DeviceMapPlanner:
    """The state of one :func:`infer_auto_device_map` run."""

    def __init__(
        self,
        model: nn.Module,
        max_memory: Mapping[int | str, int | str] | None,
        no_split: list[str],
        dtype: DtypeLike | None,
        special_dtypes: Mapping[str, DtypeLike] | None,
        verbose: bool,
    ) -> None:
        self.budget = get_max_memory(max_memory)
        self.devices: list[int | str] = [*self.budget, *([] if "disk" in self.budget else ["disk"])]
        self.accelerators = [device for device in self.devices if device not in ("cpu", "disk")]
        if "mps" in self.accelerators:
            self.main_devices: list[int | str] = ["mps"]
        elif self.accelerators:
            self.main_devices = [self.accelerators[0], "cpu"]
        else:
            self.main_devices = ["cpu"]
        self.no_split = no_split
        self.dtype = dtype
        self.special_dtypes = special_dtypes
        self.verbose = verbose
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
        self.ties = find_tied_parameters(model)
        if check_tied_parameters_in_config(model) and not self.ties:
            logger.warning(
                "The model weights are not tied. Please use the `tie_weights` method before using the "
                "`infer_auto_device` function."
            )
        self.pending: list[NamedItem] = [
            *model.named_parameters(recurse=False),
            *model.named_children(),
            *model.named_buffers(recurse=False),
        ]
        self.device_map: OrderedDict[str, int | str] = OrderedDict()
        self.used: dict[int | str, float] = dict.fromkeys(self.devices, 0)
        self.buffer_sizes: dict[int | str, int] = {}
        self.minimum_needed: dict[int | str, float] = {}
        self.current = 0
        self._refresh_max_layer()

    def _say(self, message: str) -> None:
        if self.verbose:
            print(message)

    def _refresh_max_layer(self) -> None:
        modules = [(n, m) for n, m in self.pending if isinstance(m, nn.Module)]
        self.max_layer_size, self.max_layer_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _place(self, name: str, module: Any, device: int | str, size: float, tied_names: list[str]) -> None:
        self._say(f"Putting {name}" + (f" and {tied_names}" if tied_names else f" (size={size})") + f" on {device}.")
        self.used[device] += size
        self.device_map[name] = device
        for tied_name in tied_names:
            self.pending = [(n, m) for n, m in self.pending if n != tied_name]
            self.device_map[tied_name] = device
        if isinstance(module, nn.Module):
            buffers = compute_module_total_buffer_size(module, dtype=self.dtype, special_dtypes=self.special_dtypes)
            self.buffer_sizes[device] = self.buffer_sizes.get(device, 0) + buffers

    def _split_a_tied_module(self, name: str, module: Any, tied_names: list[str], tied_modules: list[Any]) -> bool:
        """Replace the first splittable tied module by its children (the current module first again)."""
        for tied_name, tied_module in zip(tied_names, tied_modules, strict=True):
            if not _splittable(tied_module, self.no_split):
                continue
            self._say(f"Splitting {tied_name}.")
            index = next(i for i, (n, _) in enumerate(self.pending) if n == tied_name)
            self.pending[index : index + 1] = _children(tied_name, tied_module)
            self.pending.insert(0, (name, module))
            self._refresh_max_layer()
            return True
        return False

    def _try_fallback(self, name: str, module: Any, device: int | str, size_with_ties: float) -> bool:
        limit = self.budget[device] - max(self.max_layer_size, size_with_ties) - self.used[device]
        found, found_module, rest = fallback_allocate(self.pending, self.sizes, limit, self.no_split, self.ties)
        if found_module is None:
            return False
        self.pending = [(found, found_module), (name, module), *rest]  # type: ignore[list-item]
        return True

    def step(self, fallback_allocation: bool) -> None:
        """Place (or split) the next pending module, or move on to the next device."""
        name, module = self.pending.pop(0)
        self._say(f"\nTreating module {name}.")
        self.max_layer_names = [n for n in self.max_layer_names if not _inside(name, n)]
        if not self.max_layer_names:
            self._refresh_max_layer()
        size = self.sizes[name]
        tied_params = _outside_ties(name, self.ties)
        device = self.devices[self.current]
        reserved = self.max_layer_size if device in self.main_devices else 0
        room = None if device == "disk" else self.budget[device] - reserved
        size_with_ties, tied_names, tied_modules = get_module_size_with_ties(
            tied_params, size, self.sizes, self.pending
        )
        if room is None or self.used[device] + size_with_ties <= room:
            self._place(name, module, device, size_with_ties, tied_names)
            return
        if (
            tied_params
            and self.used[device] + size <= room
            and self._split_a_tied_module(name, module, tied_names, tied_modules)
        ):
            return
        if self.used[device] + size >= room and _splittable(module, self.no_split):
            self._say(f"Splitting {name}.")
            self.pending = _children(name, module) + self.pending
            self._refresh_max_layer()
            return
        if self.used[device] == 0 and fallback_allocation and self._try_fallback(name, module, device, size_with_ties):
            return
        if self.used[device] == 0:
            self.minimum_needed[device] = size_with_ties + reserved
        self._say(f"Not enough space on {device} for {name}, going to the next device.")
        self.used[device] += reserved
        self.current += 1
        self.pending.insert(0, (name, module))

    def warn_about_buffers(self) -> None:
        """Warn if the offloaded layers' buffers (loaded all at once) fit on no accelerator."""
        offloaded = self.buffer_sizes.get("cpu", 0) + self.buffer_sizes.get("disk", 0)
        if offloaded == 0 or not self.accelerators:
            return
        used = {device: size for device, size in self.used.items() if size > 0}
        if not any(
            self.budget[device] >= offloaded + used.get(device, 0)
            for device in self.budget
            if device not in ("cpu", "disk")
        ):
            warnings.warn(
                f"Current model requires {offloaded} bytes of buffer for offloaded layers, which seems does not fit "
                "any GPU's remaining memory. If you are experiencing a OOM later, please consider using "
                "offload_buffers=True.",
                stacklevel=3,
            )

    def report_unused_devices(self) -> None:
        if not self.minimum_needed:
            return
        needs = "\n".join(f"  - {device}: {size} bytes required" for device, size in self.minimum_needed.items())
        logger.info(
            "Based on the current allocation process, no modules could be assigned to the following devices due to "
            f"insufficient memory:\n{needs}\nThese minimum requirements are specific to this allocation attempt and "
            "may vary. Consider increasing the available memory for these devices to at least the specified minimum, "
            "or adjusting the model config."
        )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: str | Iterable[str] | None = None,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, int | str]:
    """A device map for ``model``: accelerators first, then the CPU, then the disk, as Accelerate plans it.

    Only sizes and dtypes are read, so the model can be on the meta device (built under ``init_empty_weights``).

    Args:
        model: The model to place.
        max_memory: Budget per device (``{0: "10GiB", "cpu": "30GiB"}``); the free memory of each device by default.
        no_split_module_classes: Class names of modules never split across devices (blocks with residual
            connections, for instance).
        dtype: The dtype the weights will be loaded in.
        special_dtypes: Per-tensor dtypes overriding ``dtype``.
        verbose: Print each decision.
        clean_result: Merge the entries of submodules that share a device into their parent's.
        offload_buffers: The offloaded layers' buffers are offloaded too (otherwise they are counted against the
            accelerators, with a warning when they fit on none).
        fallback_allocation: When nothing fits on a device, look breadth-first for a submodule that does.

    Returns:
        Module (or tensor) names to devices.

    """
    no_split = _checked_no_split_names(model, no_split_module_classes)
    planner = _DeviceMapPlanner(model, max_memory, no_split, dtype, special_dtypes, verbose)
    while planner.pending:
        planner.step(fallback_allocation)
    device_map: MutableMapping[str, int | str] = planner.device_map
    _cover_split_buffers(model, device_map)
    if clean_result:
        clean_device_map(device_map)
    if not offload_buffers:
        planner.warn_about_buffers()
    planner.report_unused_devices()
    return dict(device_map)


def _cover_split_buffers(model: nn.Module, device_map: MutableMapping[str, int | str]) -> None:
    """Give the direct buffers of split modules (never planned on their own) their module's first child's device."""
    for name in model.state_dict():
        if any(_inside(key, name) for key in device_map):
            continue
        parent = name.rpartition(".")[0]
        sibling = next((key for key in device_map if key.startswith(parent + ".")), None)
        if sibling is not None:
            device_map[name] = device_map[sibling]


def clean_device_map(device_map: MutableMapping[str, Any], module_name: str = "") -> MutableMapping[str, Any]:
    """Merge the entries under ``module_name`` into one when they all share a device, recursively (in place).

    Example:
        >>> clean_device_map({"a.x": 0, "a.y": 0, "b": 1})
        {'a': 0, 'b': 1}

    """
    prefix = f"{module_name}." if module_name else ""
    keys = [key for key in device_map if key.startswith(prefix)]
    values = [device_map[key] for key in keys]
    if len(keys) > 1 and len(set(values)) == 1:
        merged = {}
        for key, value in device_map.items():
            if key == keys[0]:
                merged[module_name] = value
            elif key not in keys:
                merged[key] = value
        device_map.clear()
        device_map.update(merged)
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = dict.fromkeys(
        ".".join(key.split(".")[:depth]) for key in device_map if key.startswith(prefix) and len(key) > len(module_name)
    )
    for child in children:
        clean_device_map(device_map, child)
    return device_map


def check_device_map(model: nn.Module, device_map: Mapping[str, DeviceLike]) -> None:
    """Check that ``device_map`` names only the model's modules and tensors, and gives each tensor a device.

    Accelerate 1.15 only warns about a key that names nothing in the model; here it is an error, since the module the
    key was meant for (a typo, another model's name) silently gets no device of its own.

    Raises:
        ValueError: Naming the keys that match nothing in the model, or the tensors without a device.

    """
    known = set(dict(model.named_modules())) | set(model.state_dict())
    invalid = [key for key in device_map if key and key not in known]
    if invalid:
        top_level = [name for name, _ in model.named_children()] + [
            name for name, _ in model.named_parameters(recurse=False)
        ]
        raise ValueError(
            f"device_map keys {invalid} match no submodule, parameter or buffer of the model "
            f"({type(model).__name__}, whose top-level names are {top_level}); fix their spelling or remove them"
        )
    if "" in device_map:
        return
    uncovered = [name for name in model.state_dict() if not any(_inside(key, name) for key in device_map)]
    if uncovered:
        raise ValueError(
            "The device_map provided does not give any device for the following parameters: " + ", ".join(uncovered)
        )


def strategy_device_map(
    model: nn.Module,
    strategy: str,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: str | Iterable[str] | None = None,
    dtype: DtypeLike | None = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    offload_buffers: bool = False,
) -> dict[str, int | str]:
    """The device map a strategy of :data:`DEVICE_MAP_STRATEGIES` names (the caller checked the name).

    ``"sequential"`` fills the devices in order up to ``max_memory``; the others first spread ``max_memory`` evenly
    over the accelerators (:func:`get_balanced_memory`; ``"balanced_low_0"`` keeps accelerator 0 as free as possible).
    """
    if strategy != "sequential":
        max_memory = get_balanced_memory(
            model,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            special_dtypes=special_dtypes,
            low_zero=strategy == "balanced_low_0",
        )
    return infer_auto_device_map(
        model,
        max_memory=max_memory,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        special_dtypes=special_dtypes,
        offload_buffers=offload_buffers,
    )
