"""Accelerate's weight offload: tensors saved as memory-mapped ``.dat`` files with an ``index.json``, read back lazily.

The folder layout is Accelerate's (one ``<name>.dat`` per tensor, ``index.json`` mapping each name to its ``dtype`` and
``shape``), so a folder written by either library is read by the other. NumPy has no bfloat16 or float8, so those are
stored as the same bytes viewed as int16 / int8 and viewed back on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from lightning_accel.utils.memory import DeviceLike, resolve_device

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]

_INDEX_FILE = "index.json"


def _numpy_stand_in(dtype_name: str) -> str:
    """The NumPy dtype whose bytes hold a torch dtype NumPy lacks (bfloat16 -> int16, float8_* -> int8)."""
    if dtype_name == "bfloat16":
        return "int16"
    if dtype_name.startswith("float8_"):
        return "int8"
    return dtype_name


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike[str], index: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat`` and record its dtype and shape in ``index``.

    Args:
        weight: The tensor.
        weight_name: Its name (the file's stem and the index key).
        offload_folder: An existing folder.
        index: The index to add the entry to (nothing is recorded when ``None``).

    Returns:
        ``index``.

    """
    dtype_name = str(weight.dtype).removeprefix("torch.")
    stand_in = _numpy_stand_in(dtype_name)
    if stand_in != dtype_name:
        weight = weight.view(getattr(torch, stand_in))
    array = weight.detach().cpu().numpy()
    if index is not None:
        index[weight_name] = {
            "dtype": dtype_name if stand_in != dtype_name else str(array.dtype),
            "shape": list(array.shape),
        }
    if array.ndim == 0:  # memmaps cannot be 0-d
        array = array[None]
    stored = np.memmap(
        os.path.join(offload_folder, f"{weight_name}.dat"), dtype=array.dtype, mode="w+", shape=array.shape
    )
    stored[:] = array[:]
    stored.flush()
    return index


def load_offloaded_weight(weight_file: str | os.PathLike[str], weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read a tensor written by :func:`offload_weight`, given its index entry (``dtype`` and ``shape``)."""
    shape = tuple(weight_info["shape"])
    dtype_name = weight_info["dtype"]
    stored = np.memmap(weight_file, dtype=_numpy_stand_in(dtype_name), shape=shape or (1,), mode="r")
    tensor = torch.tensor(stored[0] if not shape else stored)
    if _numpy_stand_in(dtype_name) != dtype_name:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor


def save_offload_index(index: Mapping[str, Any] | None, offload_folder: str | os.PathLike[str]) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (created if missing; nothing written for an empty index)."""
    if not index:
        return
    index_file = os.path.join(offload_folder, _INDEX_FILE)
    current: dict[str, Any] = {}
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            current = json.load(f)
    current.update(index)
    with open(index_file, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=2)


def offload_state_dict(save_dir: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` (created if needed), with its ``index.json``.

    Args:
        save_dir: The folder.
        state_dict: Names to tensors.

    """
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


class PrefixedDataset(Mapping[str, Any]):
    """A view of a mapping that adds ``prefix`` to every key looked up (a submodule's view of the model's weights).

    Args:
        dataset: A mapping with string keys.
        prefix: Added in front of each key (``"linear1."``).

    """

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        # Accelerate counts the whole underlying mapping; kept so both report the same length.
        return len(self.dataset)


class OffloadedWeightsLoader(Mapping[str, torch.Tensor]):
    """The weights of a model, some in memory and others on disk, read from disk only when looked up.

    Args:
        state_dict: Weights in memory (they win over an offloaded entry of the same name).
        save_folder: The folder written by :func:`offload_state_dict` (its ``index.json`` is read unless ``index``
            is given).
        index: Name to ``{"dtype", "shape"}`` for ``.dat`` files, or to ``{"safetensors_file", "weight_name",
            "dtype"}`` for tensors read from a safetensors checkpoint.
        device: Where safetensors entries are read to (the CPU by default).

    Raises:
        ValueError: When none of ``state_dict``, ``save_folder`` and ``index`` is given.

    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike[str] | None = None,
        index: Mapping[str, Any] | None = None,
        device: DeviceLike | None = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = dict(state_dict) if state_dict is not None else {}
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            with open(os.path.join(save_folder, _INDEX_FILE), encoding="utf-8") as f:
                index = json.load(f)
        self.index: Mapping[str, Any] = index if index is not None else {}
        self.all_keys = [*self.state_dict, *(key for key in self.index if key not in self.state_dict)]
        self.device = device
        self._aliases: dict[str, str] = {}

    def alias(self, name: str, stored_as: str) -> None:
        """Make ``name`` read the weight stored as ``stored_as`` (a tied weight, saved once under another name).

        Raises:
            KeyError: If ``stored_as`` is not in this loader.

        """
        if stored_as not in self:
            raise KeyError(f"Cannot alias {name!r} to {stored_as!r}: {stored_as!r} is not in this loader.")
        if name not in self:
            self._aliases[name] = self._aliases.get(stored_as, stored_as)
            self.all_keys.append(name)

    def __getitem__(self, key: str) -> torch.Tensor:
        key = self._aliases.get(key, key)
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            return self._read_safetensors(key, info)
        if self.save_folder is None:
            raise KeyError(
                f"{key!r} is indexed as a .dat file, but this loader was given no save_folder to read it from."
            )
        return load_offloaded_weight(os.path.join(self.save_folder, f"{key}.dat"), info)

    def _read_safetensors(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        device = "cpu" if self.device is None else str(resolve_device(self.device))
        name = info.get("weight_name", key)
        try:
            with safe_open(info["safetensors_file"], framework="pt", device=device) as f:
                tensor: torch.Tensor = f.get_tensor(name)
        except TypeError:  # a dtype the device cannot read (bf16 on MPS): read on the CPU, then move
            with safe_open(info["safetensors_file"], framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
        if "dtype" in info:
            tensor = tensor.to(getattr(torch, info["dtype"]))
        return tensor.to(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def extract_submodules_state_dict(state_dict: Mapping[str, Any], submodule_names: Sequence[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` belonging to the named submodules (``"a.1"`` takes ``"a.1.x"``, not ``"a.10"``).

    Args:
        state_dict: Names to tensors.
        submodule_names: The submodules' names.

    """
    result: dict[str, Any] = {}
    for module_name in submodule_names:
        result.update(
            {key: value for key, value in state_dict.items() if key == module_name or key.startswith(module_name + ".")}
        )
    return result
