"""``lightning-accel estimate-memory``: a model's size and training memory, in ``accelerate estimate-memory``'s table.

The model is built on the meta device (no memory, no weights read): from a class or factory (``module:Class``), a
torchvision or timm architecture, a transformers config (a model type such as ``bert``, a local folder with
``config.json``, or a Hub id already in the local cache), or the tensor shapes of a safetensors/``.bin`` checkpoint.
Sizes are in float32, as Accelerate counts them; the other dtypes divide them.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_accel.utils.other import convert_bytes, load

__all__ = ["add_estimate_memory_parser", "checkpoint_meta_model", "estimate_table", "meta_model"]

_DTYPES = ["float32", "float16", "int8", "int4"]
_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
_HEADERS = ["dtype", "Largest Layer", "Total Size", "Training using Adam"]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# safetensors dtype names of the tensors that are not floating point (floating ones are counted as float32).
_SAFETENSORS_INTEGER = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}


def add_estimate_memory_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``estimate-memory`` to ``commands``."""
    parser = commands.add_parser(
        "estimate-memory", help="Estimate a model's memory (loading and training with Adam), built on the meta device."
    )
    parser.add_argument(
        "model_name",
        help="module:Class (or a factory), a torchvision/timm/transformers name, a transformers config folder, or "
        "a safetensors/.bin checkpoint (file, or folder with an index).",
    )
    parser.add_argument(
        "--library_name",
        choices=["transformers", "timm", "torchvision"],
        default=None,
        help="Which library builds a named model (default: torchvision or timm if they know it, else transformers).",
    )
    parser.add_argument("--dtypes", nargs="+", default=list(_DTYPES), choices=_DTYPES, help="Rows of the table.")
    parser.add_argument(
        "--trust_remote_code", action="store_true", help="Let transformers run a model's own modeling code."
    )
    parser.set_defaults(handler=_run_estimate_memory)


# ---------------------------------------------------------------------------------------------------- the table


def _adam_training_bytes(total: int, dtype: str) -> int | None:
    """Peak bytes of an Adam step at batch size 1 (the optimizer step, Accelerate's estimate); ``None`` for ints.

    float32 keeps weights, gradients and two Adam moments in float32 and needs them all at the step. float16 means
    mixed precision: float32 master weights and moments; its peak is the two moments.
    """
    if dtype == "float32":
        return 4 * total
    if dtype == "float16":
        return 2 * total
    return None


def _table_rows(total: int, largest: int, dtypes: Iterable[str]) -> list[list[str]]:
    rows = []
    for dtype in dtypes:
        divisor = _DIVISOR[dtype]
        # Accelerate divides (giving floats, "12.0 bytes") for every dtype but float32.
        layer, size = (largest, total) if divisor == 1 else (largest / divisor, total / divisor)
        training = _adam_training_bytes(total, dtype)
        rows.append(
            [dtype, convert_bytes(layer), convert_bytes(size), "N/A" if training is None else convert_bytes(training)]
        )
    return rows


def _box(headers: list[str], rows: list[list[str]], title: str) -> str:
    """A box-drawn table with a title, every cell centered.

    A title longer than the columns widens the last one, as Accelerate's table does: by twice the difference between
    the title and the inner width.
    """
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    if len(title) > sum(widths):
        widths[-1] += 2 * abs(len(title) - (sum(widths) + len(widths) + 1))
    inner = sum(widths) + len(widths) - 1

    def line(cells: list[str]) -> str:
        return "│" + "│".join(cell.center(width) for cell, width in zip(cells, widths, strict=True)) + "│"

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    return "\n".join(
        [
            "┌" + "─" * inner + "┐",
            "│" + title.center(inner) + "│",
            rule("├", "┬", "┤"),
            line(headers),
            rule("├", "┼", "┤"),
            *(line(row) for row in rows),
            rule("└", "┴", "┘"),
        ]
    )


def estimate_table(model: nn.Module, name: str, dtypes: Iterable[str] = _DTYPES) -> str:
    """The table ``accelerate estimate-memory`` prints for ``model``.

    Per dtype: the largest layer, the total size and the peak of training with Adam at batch size 1.

    Args:
        model: The model, on the meta device or not (only sizes are read), in float32.
        name: What the title calls it.
        dtypes: The rows, among ``float32``, ``float16``, ``int8`` and ``int4``.

    """
    from lightning_accel.utils.modeling.sizes import calculate_maximum_sizes

    total, (largest, _) = calculate_maximum_sizes(model)
    return _box(_HEADERS, _table_rows(total, largest, dtypes), f"Memory Usage for loading `{name}`")


# ------------------------------------------------------------------------------------------ building the model


def _tree_module(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> nn.Module:
    """A module tree whose buffers are meta tensors of these names, shapes and dtypes (a state dict's layout)."""
    root = nn.Module()
    for key, (shape, dtype) in shapes.items():
        *path, leaf = key.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_buffer(leaf, torch.empty(shape, dtype=dtype, device="meta"))
    return root


def _as_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(path), framework="pt") as file:
        for key in file.keys():  # noqa: SIM118 (a safetensors file is not a mapping)
            tensor = file.get_slice(key)
            shapes[key] = (tuple(tensor.get_shape()), _SAFETENSORS_INTEGER.get(tensor.get_dtype(), torch.float32))
    return shapes


def _torch_file_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    try:
        state = load(path, map_location="meta")
    except Exception as err:  # torch raises many kinds for files it cannot unpickle safely
        raise ValueError(f"{path} is not a state dict torch.load can read with weights_only=True ({err})") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return {key: (tuple(value.shape), _as_float32(value.dtype)) for key, value in state.items()}


def _checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: the file itself, or those a folder's index (or single file) names."""
    if path.is_file():
        if path.name.endswith(".index.json"):
            weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map", {})
            return [path.parent / name for name in sorted(set(weight_map.values()))]
        return [path]
    for name in _INDEX_FILES:
        if (path / name).is_file():
            return _checkpoint_files(path / name)
    found = [path / name for name in _WEIGHT_FILES if (path / name).is_file()]
    if not found:
        raise ValueError(f"{path} holds no {' or '.join(_INDEX_FILES + _WEIGHT_FILES)}")
    return found[:1]


def checkpoint_meta_model(path: Path) -> nn.Module:
    """A meta-device module with the tensors of a safetensors/``.bin`` checkpoint (floating point ones in float32)."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in _checkpoint_files(path):
        read = _safetensors_shapes if file.suffix == ".safetensors" else _torch_file_shapes
        shapes.update(read(file))
    if not shapes:
        raise ValueError(f"the checkpoint {path} holds no tensors")
    return _tree_module(shapes)


def _import_factory(spec: str) -> Callable[[], Any]:
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r} from {spec!r} ({err}); is it on PYTHONPATH?") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{module_name!r} has no {attribute!r}; pass module:Class with a class it defines")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is a {type(target).__name__}, not a class or function building a model")
    return target


def _transformers_model(name: str, trust_remote_code: bool) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"building {name!r} needs transformers: pip install transformers") from None
    print(f"Loading pretrained config for `{name}` from `transformers`...")
    if name in transformers.CONFIG_MAPPING:
        config = transformers.AutoConfig.for_model(name)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"transformers found no config for {name!r} ({err}); pass a model type (bert, gpt2, ...), a folder "
                "with config.json, a Hub id in the local cache, module:Class or a checkpoint file"
            ) from None
    constructor = transformers.AutoModel
    auto_map = getattr(config, "auto_map", None) or {}
    for key in auto_map:  # remote code may name its own AutoModelFor* class
        if key.startswith("AutoModelFor") and hasattr(transformers, key):
            constructor = getattr(transformers, key)
            break
    model: nn.Module = constructor.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model


def _torchvision_names() -> list[str]:
    try:
        from torchvision import models
    except ImportError:
        return []
    return list(models.list_models())


def _named_model(name: str, library: str | None, trust_remote_code: bool) -> nn.Module:
    if library == "torchvision" or (library is None and name in _torchvision_names()):
        try:
            from torchvision import models
        except ImportError:
            raise ValueError("--library_name torchvision needs torchvision: pip install torchvision") from None
        return models.get_model(name, weights=None)
    if library == "timm" or (library is None and _timm_knows(name)):
        try:
            import timm
        except ImportError:
            raise ValueError("--library_name timm needs timm: pip install timm") from None
        return timm.create_model(name, pretrained=False)
    return _transformers_model(name, trust_remote_code)


def _timm_knows(name: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return bool(timm.list_models(name))


def _is_checkpoint(path: Path) -> bool:
    if path.is_file():
        return path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json")
    has_config = (path / "config.json").is_file()
    return path.is_dir() and not has_config and any((path / n).is_file() for n in _INDEX_FILES + _WEIGHT_FILES)


def meta_model(name: str, library_name: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Build the model ``name`` stands for on the meta device.

    Args:
        name: ``module:Class`` (or ``module:factory``; called without arguments), a safetensors/``.bin`` checkpoint
            (a file, an ``*.index.json`` or a folder holding them), or a model name for ``library_name``.
        library_name: ``transformers``, ``timm`` or ``torchvision`` for a named model; by default torchvision or
            timm when they know the name, else transformers (a model type, a config folder or a cached Hub id).
        trust_remote_code: Let transformers run a model's own code.

    Raises:
        ValueError: If nothing builds a model from ``name``; the message says what ``name`` may be.

    """
    from lightning_accel.big_modeling import init_empty_weights

    path = Path(name)
    if library_name is None and _is_checkpoint(path):
        return checkpoint_meta_model(path)
    if library_name is None and ":" in name and not path.exists():
        factory = _import_factory(name)
        with init_empty_weights():
            model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name!r} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    with init_empty_weights():
        return _named_model(name, library_name, trust_remote_code)


def _run_estimate_memory(args: argparse.Namespace) -> int:
    model = meta_model(args.model_name, args.library_name, args.trust_remote_code)
    print(estimate_table(model, args.model_name, args.dtypes))
    return 0
