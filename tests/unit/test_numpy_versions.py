"""``lightning_accel`` under numpy 1.26 (litgpt pins ``numpy<2``) and numpy 2: the safe globals ``load`` allows.

The clients stage runs this file in litgpt's environment (numpy 1.26) as well as in the main one (numpy 2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lightning_accel.utils import load
from lightning_accel.utils.other import TORCH_SAFE_GLOBALS


def test_the_allowed_reconstruct_is_the_one_numpy_pickles_arrays_with() -> None:
    reconstruct = np.arange(3).__reduce__()[0]
    assert reconstruct is TORCH_SAFE_GLOBALS[0]
    # torch's weights_only unpickler matches globals by their import path, which differs between numpy 1 and 2.
    expected_module = "numpy.core.multiarray" if np.__version__.startswith("1.") else "numpy._core.multiarray"
    assert reconstruct.__module__ == expected_module


def test_numpy_random_state_loads_with_weights_only(tmp_path: Path) -> None:
    np.random.seed(3)
    state = {"numpy_random_seed": np.random.get_state()}  # what save_state writes into random_states_{i}.pkl
    torch.save(state, tmp_path / "random_states_0.pkl")
    loaded = load(tmp_path / "random_states_0.pkl")["numpy_random_seed"]
    assert loaded[0] == "MT19937" and loaded[1].dtype == np.uint32
    assert np.array_equal(loaded[1], state["numpy_random_seed"][1]) and loaded[2:] == state["numpy_random_seed"][2:]
