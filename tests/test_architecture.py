"""The layout ARCHITECTURE.md describes, enforced: which way imports go, where private modules live, file sizes.

Imports are read from the source (module level and inside functions alike), so a lazy import that points up a layer
fails here as a top-level one would.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_accel"
MAX_LINES = 600

# The Accelerator shim: its public modules at Accelerate's paths and its private subpackage.
SHIM = (
    "accelerator",
    "_shim",
    "data_loader",
    "optimizer",
    "scheduler",
    "checkpointing",
    "tracking",
    "launchers",
    "local_sgd",
    "inference",
)
PROCESS = ("state", "logging")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {target for target in found if target.startswith("lightning_accel.")}


@cache
def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imported(path) for path in PACKAGE.rglob("*.py")}


def _layer(target: str) -> str:
    """The first component under the package: ``lightning_accel.utils.operations`` -> ``utils``."""
    return target.split(".")[1]


def _violations(source_layers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.count(".") and _layer(module) in source_layers
        for target in targets
        if _layer(target) in forbidden
    )


RULES = [
    pytest.param(
        ("config", "enums"),
        ("strategies", "precision", "callbacks", "utils", "cli", "big_modeling", "hooks", *PROCESS, *SHIM),
        id="config and enums are data",
    ),
    pytest.param(PROCESS, ("strategies", "precision", "callbacks", "cli", *SHIM), id="process state below utils"),
    pytest.param(("utils",), ("strategies", "callbacks", "cli", *SHIM), id="utils imports no shim"),
    pytest.param(("precision",), ("strategies", "callbacks", "cli", *SHIM), id="precision below strategies"),
    pytest.param(("strategies",), ("callbacks", "cli", *SHIM), id="strategies import no shim"),
    pytest.param(("callbacks",), ("cli", *SHIM), id="callbacks beside the shim"),
    pytest.param(("big_modeling", "hooks"), ("strategies", "callbacks", "cli", *SHIM), id="big models below"),
    pytest.param(
        ("checkpoint",),
        ("precision", "big_modeling", "hooks", "strategies", "callbacks", "cli", *SHIM),
        id="checkpoint just above utils",
    ),
    pytest.param(("utils", *PROCESS), ("checkpoint",), id="utils below checkpoint"),
]


@pytest.mark.parametrize(("sources", "forbidden"), RULES)
def test_imports_point_down_the_layers(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert _violations(sources, forbidden) == []


def test_only_utils_amp_wraps_a_precision_plugin() -> None:
    users = {module for module, targets in _graph().items() if module.startswith("lightning_accel.utils.")}
    users = {module for module in users if any(_layer(target) == "precision" for target in _graph()[module])}
    assert users <= {"lightning_accel.utils.amp"}


def test_the_shim_internals_are_used_by_the_shim_only() -> None:
    outside = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.count(".") and _layer(module) not in SHIM
        for target in targets
        if _layer(target) == "_shim"
    )
    assert outside == []


def test_nothing_imports_the_cli() -> None:
    assert _violations(tuple({_layer(m) for m in _graph() if m.count(".")} - {"cli"}), ("cli",)) == []


def test_at_most_one_private_module_at_the_package_root() -> None:
    private = sorted(
        path.name
        for path in PACKAGE.iterdir()
        if path.name.startswith("_") and path.name not in {"__init__.py", "__pycache__", "__main__.py"}
    )
    assert len(private) <= 1, private


def test_no_source_file_is_over_the_size_limit() -> None:
    long = {
        str(path.relative_to(PACKAGE)): count
        for path in PACKAGE.rglob("*.py")
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_rules_see_real_imports() -> None:
    """Guard against a parser that finds nothing: known edges of each kind are present."""
    graph = _graph()
    assert "lightning_accel._shim.fabric" in graph["lightning_accel.accelerator"]
    assert "lightning_accel.config.devices" in graph["lightning_accel.state"]  # a lazy import, inside a method
    assert "lightning_accel.strategies.registry" in graph["lightning_accel.strategies.arguments"]
