"""Accelerate's seeding and generator synchronisation."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_accel.state import PartialState

__all__ = ["get_rng_states", "set_rng_states", "set_seed", "synchronize_rng_state", "synchronize_rng_states"]

_RNG_TYPES = ("torch", "cuda", "generator")


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python's ``random``, numpy and torch (every CUDA device too).

    Args:
        seed: The seed.
        device_specific: Add the process index, so each process draws differently.
        deterministic: Also ask torch for deterministic algorithms.

    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: str | None = None, generator: torch.Generator | None = None) -> None:
    """Give every process the generator state of process 0 (a collective call with several processes).

    Args:
        rng_type: ``"torch"`` (the global CPU generator), ``"cuda"`` (the current CUDA device's) or ``"generator"``.
        generator: The generator for ``rng_type="generator"``.

    Raises:
        ValueError: For another ``rng_type``, or ``"generator"`` without ``generator``.

    """
    name = str(getattr(rng_type, "value", rng_type))
    if name not in _RNG_TYPES:
        raise ValueError(f"rng_type={rng_type!r} cannot be synchronised; use one of {list(_RNG_TYPES)}.")
    if name == "generator" and generator is None:
        raise ValueError("rng_type='generator' needs the generator to synchronise: pass generator=...")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if name == "cuda" and not torch.cuda.is_available():
        return
    getters: dict[str, Any] = {
        "torch": (torch.get_rng_state, torch.set_rng_state),
        "cuda": (torch.cuda.get_rng_state, torch.cuda.set_rng_state),
        "generator": (generator.get_state, generator.set_state) if generator is not None else None,
    }
    get_state, set_state = getters[name]
    state = get_state()
    # NCCL broadcasts device tensors only.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else state.device
    shared = state.to(device)
    dist.broadcast(shared, src=0)
    set_state(shared.cpu())


def synchronize_rng_states(rng_types: Sequence[str], generator: torch.Generator | None = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types`` (``"generator"`` is skipped without a generator)."""
    for rng_type in rng_types:
        if str(getattr(rng_type, "value", rng_type)) == "generator" and generator is None:
            continue
        synchronize_rng_state(rng_type, generator)


def get_rng_states(step: int) -> dict[str, Any]:
    """The generator states of this process and ``step``, under the keys of Accelerate's ``random_states_{i}.pkl``.

    numpy's state is ``np.random.get_state()``; CUDA's is there where CUDA is available.
    """
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore Python's, numpy's, torch's (and CUDA's, where saved and present) generators."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
