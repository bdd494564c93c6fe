"""Start-up of every process of the diffusers client, on both sides (the one offline patch, the same on both).

- ``train_unconditional.py`` has no ``--seed``: it builds its UNet from a config with torch's unseeded generator, so
  two runs would not start from the same weights. Every process seeds torch, NumPy and ``random`` with 0 here, before
  the script runs, the same on both sides (the text-to-image script seeds itself with ``--seed`` on top).
- The alias of ``accelerate`` to lightning_accel on our side, as in the other clients
  (``tests/clients/transformers_trainer/site/sitecustomize.py``, loaded from there).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import torch

_HERE = Path(__file__).resolve().parents[1]

torch.manual_seed(0)
np.random.seed(0)
random.seed(0)

_shared = _HERE.parent / "transformers_trainer" / "site" / "sitecustomize.py"
_spec = importlib.util.spec_from_file_location("clients_shared_site", _shared)
assert _spec is not None and _spec.loader is not None
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
