"""Import ``accelerate`` as ``lightning_accel`` in this process and in every Python process it starts.

The peer stage puts this folder on ``PYTHONPATH`` with ``LIGHTNING_ACCEL_ALIAS=1``, so Python runs this file at start-up
in the test process and in each child it spawns (``debug_launcher``, ``accelerate launch``, ``torchrun``). The mapping
is mechanical: ``accelerate.<path>`` is ``lightning_accel.<path>``; a module that lightning_accel lacks fails to import,
as it would for a user who changed the imports. ``accelerate.test_utils`` stays Hugging Face's own helpers (loaded from
the installed accelerate), and their relative imports (``..state``, ``..utils``) resolve through the alias to ours.

With ``LIGHTNING_ACCEL_ALIAS_LOG`` naming a file, each aliased module is appended to it (one line per module and
process), which the stage prints.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_OURS = "lightning_accel"
_THEIRS = "accelerate"
_KEPT = "accelerate.test_utils"


class _ExistingModule(importlib.abc.Loader):
    """Hand an already-imported lightning_accel module to the import system under its Accelerate name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        return None


class _AccelerateFacade(ModuleType):
    """``accelerate`` itself: lightning_accel's attributes (read, set and deleted there), with Accelerate's version.

    Programs gate on ``accelerate.__version__`` (diffusers' scripts register their checkpoint hooks only from 0.16.0),
    so the top-level module reports the Accelerate release whose API lightning_accel implements
    (``lightning_accel.accelerate_api_version``) rather than lightning_accel's own version.
    """

    def __init__(self, ours: ModuleType) -> None:
        super().__init__(_THEIRS, ours.__doc__)
        vars(self).update(__path__=list(ours.__path__), __file__=ours.__file__, _ours=ours)

    def __getattr__(self, name: str) -> Any:
        ours = vars(self)["_ours"]  # read late: lightning_accel may still be initialising when this is made
        return ours.accelerate_api_version if name == "__version__" else getattr(ours, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):
            super().__setattr__(name, value)
        else:
            setattr(vars(self)["_ours"], name, value)

    def __delattr__(self, name: str) -> None:
        delattr(vars(self)["_ours"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(vars(self)["_ours"])) | set(vars(self)))


class _DeferredModule(importlib.abc.Loader):
    """Import lightning_accel only when ``accelerate`` itself is imported, not when a library merely looks for it.

    ``import transformers`` asks ``importlib.util.find_spec("accelerate")`` while it is half initialised; importing
    lightning_accel then (lightning -> torchmetrics -> transformers) would be a circular import.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _AccelerateFacade(importlib.import_module(self.name))

    def exec_module(self, module: ModuleType) -> None:
        return None


class AccelerateAlias(importlib.abc.MetaPathFinder):
    """Resolve ``accelerate`` and its submodules to lightning_accel, except Accelerate's test helpers."""

    def __init__(self, log: str | None) -> None:
        self.log = log
        self._real = importlib.machinery.PathFinder.find_spec(_THEIRS)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _THEIRS and not fullname.startswith(_THEIRS + "."):
            return None
        if fullname == _KEPT or fullname.startswith(_KEPT + "."):
            return self._real_spec(fullname)
        ours = _OURS + fullname[len(_THEIRS) :]
        if fullname == _THEIRS and _OURS not in sys.modules:
            return self._deferred_spec()
        try:
            module = importlib.import_module(ours)
        except ModuleNotFoundError as err:
            if err.name is not None and (ours == err.name or ours.startswith(err.name + ".")):
                raise ModuleNotFoundError(
                    f"No module named {fullname!r}: lightning_accel has no {ours!r}", name=fullname
                ) from None
            raise
        self._record(fullname, ours)
        if fullname == _THEIRS:
            module = _AccelerateFacade(module)
        spec = importlib.util.spec_from_loader(
            fullname, _ExistingModule(module), is_package=hasattr(module, "__path__")
        )
        if spec is not None and hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec

    def _deferred_spec(self) -> importlib.machinery.ModuleSpec | None:
        found = importlib.util.find_spec(_OURS)  # a top-level name: found without importing it
        if found is None:
            raise ModuleNotFoundError(f"No module named {_OURS!r} to stand in for {_THEIRS!r}", name=_THEIRS)
        self._record(_THEIRS, _OURS)
        spec = importlib.util.spec_from_loader(_THEIRS, _DeferredModule(_OURS), is_package=True)
        if spec is not None:
            spec.submodule_search_locations = list(found.submodule_search_locations or [])
        return spec

    def _real_spec(self, fullname: str) -> importlib.machinery.ModuleSpec | None:
        if self._real is None or self._real.submodule_search_locations is None:
            raise ModuleNotFoundError(f"{fullname!r} needs Hugging Face accelerate installed", name=fullname)
        if fullname == _KEPT:
            search = list(self._real.submodule_search_locations)
        else:
            search = list(getattr(sys.modules.get(fullname.rpartition(".")[0]), "__path__", []))
        return importlib.machinery.PathFinder.find_spec(fullname, search)

    def _record(self, theirs: str, ours: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {theirs} -> {ours}\n")


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, AccelerateAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, AccelerateAlias(os.environ.get("LIGHTNING_ACCEL_ALIAS_LOG")))


if os.environ.get("LIGHTNING_ACCEL_ALIAS") == "1":
    install()
