"""Random-number-generator states of every process, for checkpoints that resume bit-exactly."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["collect_rng_states", "gather_rng_states", "restore_rng_states"]

# Accelerate's key names in `random_states_{i}.pkl`.
PYTHON_KEY = "random_state"
NUMPY_KEY = "numpy_random_seed"
TORCH_KEY = "torch_manual_seed"
CUDA_KEY = "torch_cuda_manual_seed"


def collect_rng_states() -> dict[str, Any]:
    """The python, numpy, torch (CPU) and, where CUDA is available, every CUDA device's RNG state of this process."""
    states: dict[str, Any] = {
        PYTHON_KEY: random.getstate(),
        NUMPY_KEY: _numpy_state_as_tensors(),
        TORCH_KEY: torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states[CUDA_KEY] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Set the generators of this process to ``states`` (as returned by :func:`collect_rng_states`).

    Raises:
        ValueError: If ``states`` lacks the python, numpy or torch state, or holds CUDA states for a different number
            of devices than this process sees.

    """
    missing = [key for key in (PYTHON_KEY, NUMPY_KEY, TORCH_KEY) if key not in states]
    if missing:
        raise ValueError(f"RNG states lack {', '.join(missing)}; got keys {sorted(states)}.")
    random.setstate(states[PYTHON_KEY])
    _set_numpy_state(states[NUMPY_KEY])
    torch.set_rng_state(states[TORCH_KEY])
    if CUDA_KEY in states and torch.cuda.is_available():
        cuda_states = states[CUDA_KEY]
        if len(cuda_states) != torch.cuda.device_count():
            raise ValueError(
                f"The checkpoint holds CUDA RNG states for {len(cuda_states)} devices, but this process sees"
                f" {torch.cuda.device_count()}; resume with the same CUDA_VISIBLE_DEVICES."
            )
        torch.cuda.set_rng_state_all(cuda_states)


def _numpy_state_as_tensors() -> dict[str, Any]:
    # Checkpoints are loaded with `weights_only=True`, which refuses numpy arrays: keep only tensors and scalars.
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "bit_generator": name,
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: Mapping[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["bit_generator"], keys, state["position"], state["has_gauss"], state["cached_gaussian"]))


def gather_rng_states() -> list[dict[str, Any]]:
    """Every process's :func:`collect_rng_states`, indexed by global rank, on every process.

    This is a collective call when a default process group exists: every process must call it. It runs under the
    process group's timeout.
    """
    local = collect_rng_states()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def states_for_rank(all_states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> Mapping[str, Any] | None:
    """The saved states of ``rank``, or ``None`` when they were saved by a different number of processes."""
    if len(all_states) != world_size:
        return None
    return all_states[rank]
