"""Start-up of every process of the transformers.Trainer client, on both sides.

- Both sides: DeepSpeed's CPU backend would compile its shared-memory all-reduce kernel (minutes on a fresh machine;
  only its tensor-parallel inference uses it) when the process group starts. It is marked unbuildable as soon as
  ``deepspeed.ops`` is imported, as lightning_accel's DeepSpeed strategies do themselves, so the reference pays no
  compilation either. Training numbers do not depend on it (ZeRO talks through ``torch.distributed``).
- lightning_accel's side (``LIGHTNING_ACCEL_ALIAS=1``): ``accelerate`` is resolved to lightning_accel by the peer
  stage's alias (``tests/peer/site/sitecustomize.py``), loaded from here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_TARGET = "deepspeed.ops"


class _MarkShmUnbuildable(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.__compatible_ops__["deepspeed_shm_comm"] = False

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _MarkShmUnbuildable())

if os.environ.get("LIGHTNING_ACCEL_ALIAS") == "1":
    _alias = Path(__file__).resolve().parents[2].parent / "peer" / "site" / "sitecustomize.py"
    _spec = importlib.util.spec_from_file_location("lightning_accel_peer_alias", _alias)
    assert _spec is not None and _spec.loader is not None
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
