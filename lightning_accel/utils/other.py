"""Accelerate's ``save``/``load`` (write once per run or node, read with ``weights_only``) and model unwrapping."""

from __future__ import annotations

import os
from typing import Any, cast

import torch

from lightning_accel.state import PartialState

__all__ = ["extract_model_from_parallel", "is_compiled_module", "load", "save", "wait_for_everyone"]


def save(
    obj: Any, f: str | os.PathLike[str], save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """Save ``obj`` from the main process only (or each node's main process with ``save_on_each_node``).

    Args:
        obj: What to save; with ``safe_serialization``, a dict of tensors.
        f: The destination file.
        save_on_each_node: Write on every node's main process (for node-local disks).
        safe_serialization: Write safetensors (metadata ``{"format": "pt"}``) instead of ``torch.save``.

    Raises:
        TypeError: If ``safe_serialization`` is asked for something other than a dict of tensors.

    """
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if not safe_serialization:
        torch.save(obj, f)
        return
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise TypeError(
            f"safe_serialization=True saves a dict of tensors, got {type(obj).__name__}; pass"
            " safe_serialization=False to pickle other objects."
        )
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in obj.items()}, os.fspath(f), metadata={"format": "pt"})


def load(f: str | os.PathLike[str], map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller passes ``weights_only=False``."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def wait_for_everyone() -> None:
    """Block until every process gets here (a no-op with one process)."""
    PartialState().wait_for_everyone()


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` was returned by ``torch.compile``."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's module inside Fabric's, DDP's or DataParallel's wrappers (and ``torch.compile``'s unless kept).

    ``keep_fp32_wrapper`` is accepted for Accelerate's signature: autocast lives in the precision plugin here, not in
    a forward wrapper.
    """
    del keep_fp32_wrapper
    from lightning.fabric.wrappers import _FabricModule

    if isinstance(model, _FabricModule):
        model = model.module
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = cast(torch.nn.Module, model.module)
    if not keep_torch_compile and is_compiled_module(model):
        model = cast(torch.nn.Module, model._orig_mod)
    return model
