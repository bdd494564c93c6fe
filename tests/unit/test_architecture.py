"""The layout ARCHITECTURE.md describes, enforced: the layer order, no import circle, where modules live.

Imports are read from the source: module level, inside functions and under ``if TYPE_CHECKING:`` alike, so a lazy
import or a type-only one counts as a top-level one would. An import of ``lightning_accel.a.b`` also counts as an
import of the package ``lightning_accel.a`` (Python runs ``a/__init__.py`` first), unless the importer already sits
inside ``a``. The package root (``lightning_accel/__init__.py``) is the public facade on top of everything and is not
counted as a dependency of the modules it re-exports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = "lightning_accel"
PACKAGE = Path(__file__).resolve().parents[2] / ROOT

# Top to bottom. A module may import its own layer and the layers below it, never one above; together with
# test_no_import_circle that makes the whole package a tree of ideas one can read from the bottom up.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("integrations",),  # Ray Train: runs the strategies (and the shim) under an engine users scale out on
    (
        # callbacks, and the Accelerator shim with its public modules at Accelerate's paths
        "callbacks",
        "accelerator",
        "_accelerator",
        "data_loader",
        "optimizer",
        "scheduler",
        "checkpointing",
        "tracking",
        "launchers",
        "commands",
        "local_sgd",
        "inference",
        "parallelism_config",
    ),
    ("strategies",),
    ("precision", "big_modeling", "hooks"),
    ("checkpoint",),
    ("utils",),
    ("state", "logging"),
    ("launch_settings", "lightning_compat"),
    ("config", "enums"),
)
SHIM = LAYERS[3][1:]  # the callbacks layer less "callbacks"

# accelerate.utils's modules in Accelerate 1.15 (what ``lightning_accel.utils`` may hold).
ACCELERATE_UTILS_MODULES = frozenset(
    {
        "__init__",
        "ao",
        "bnb",
        "constants",
        "dataclasses",
        "deepspeed",
        "environment",
        "fsdp_utils",
        "imports",
        "launch",
        "megatron_lm",
        "memory",
        "modeling",
        "offload",
        "operations",
        "other",
        "random",
        "rich",
        "torch_xla",
        "tqdm",
        "transformer_engine",
        "versions",
    }
)


# Imports that break the rule because Accelerate's public API puts a function below what it needs, with why. Each is
# left out of the graph; test_accelerate_path_exceptions_are_still_needed fails once one is gone, so the list only
# shrinks.
ACCELERATE_PATH_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("lightning_accel.utils.bnb", "lightning_accel.big_modeling"): (
        "accelerate.utils.load_and_quantize_model loads an empty model through a device map and dispatches it: it"
        " needs big_modeling's init_empty_weights and dispatch_model (hooks), two layers up; imported inside it"
    ),
    ("lightning_accel.utils.fsdp_utils", "lightning_accel.checkpoint.fsdp_layout"): (
        "accelerate.utils.fsdp_utils.save_fsdp_model/load_fsdp_model/save_fsdp_optimizer/load_fsdp_optimizer write and"
        " read the one FSDP checkpoint layout (checkpoint/fsdp_layout.py, shared with save_state), a layer up: thin"
        " wrappers that import it when called"
    ),
    ("lightning_accel.utils.fsdp_utils", "lightning_accel.checkpoint"): "the package Python runs for the entry above",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(target: str) -> str | None:
    """The package's module that ``target`` (a module, or a name inside one) names; None outside the package."""
    while target not in _modules() and "." in target:
        target = target.rpartition(".")[0]
    return target if target in _modules() and target != ROOT else None


def _named(path: Path, module: str) -> Iterator[str]:
    """Every dotted name an import statement in ``path`` refers to (``from a import b`` gives ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def _with_packages(module: str, target: str) -> set[str]:
    """``target`` and the packages Python initialises to import it, less those ``module`` sits in already."""
    found = {target}
    parent = target
    while parent.count(".") > 1:
        parent = parent.rpartition(".")[0]
        found.add(parent)
    return {name for name in found if name != module and not module.startswith(f"{name}.")}


@cache
def _graph() -> dict[str, frozenset[str]]:
    graph: dict[str, frozenset[str]] = {}
    for module, path in _modules().items():
        targets = {resolved for name in _named(path, module) if (resolved := _resolve(name))}
        edges = {edge for target in targets for edge in _with_packages(module, target)}
        graph[module] = frozenset(edge for edge in edges if (module, edge) not in ACCELERATE_PATH_EXCEPTIONS)
    return graph


def _layer(module: str) -> str:
    """The first component under the package: ``lightning_accel.utils.operations`` -> ``utils``."""
    return module.split(".")[1]


def _rank(module: str) -> int:
    """Height of ``module``'s layer (0 at the bottom); -1 for a folder or file no layer names."""
    for height, names in enumerate(reversed(LAYERS)):
        if _layer(module) in names:
            return height
    return -1


def _reachable(start: str, graph: dict[str, frozenset[str]]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), frozenset()) - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _circles() -> list[list[str]]:
    """The import circles: modules that reach each other (strongly connected components of two or more)."""
    graph = _graph()
    reach = {module: _reachable(module, graph) for module in graph}
    circles = {
        tuple(sorted({module} | {other for other in reach[module] if module in reach[other]}))
        for module in graph
        if module in reach[module]
    }
    return sorted(list(circle) for circle in circles)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(module for module in _graph() if module.count(".") and _rank(module) < 0)
    assert unplaced == [], f"add each folder or root module to LAYERS (and ARCHITECTURE.md): {unplaced}"


def test_no_upward_import() -> None:
    upward = sorted(
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in _graph().items()
        if module.count(".")
        for target in targets
        if _rank(target) > _rank(module)
    )
    assert upward == [], "imports that point up a layer:\n" + "\n".join(upward)


def test_accelerate_path_exceptions_are_still_needed() -> None:
    for module, target in ACCELERATE_PATH_EXCEPTIONS:
        named = {_resolve(name) for name in _named(_modules()[module], module)}
        assert target in named, f"{module} no longer imports {target}: drop it from ACCELERATE_PATH_EXCEPTIONS"


def test_no_import_circle() -> None:
    circles = _circles()
    assert circles == [], "import circles (each line: the modules of one):\n" + "\n".join(
        f"{len(circle)} modules: {', '.join(circle)}" for circle in circles
    )


def test_callbacks_and_the_shim_do_not_import_each_other() -> None:
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.count(".")
        for target in targets
        if {_layer(module) == "callbacks", _layer(target) == "callbacks"} == {True, False}
        and {_layer(module), _layer(target)} <= {"callbacks", *SHIM}
    )
    assert crossing == []


def _strategy_probes(tree: ast.AST) -> Iterator[str]:
    """Where code branches on a strategy's class or probes it for members instead of asking the protocol.

    ``isinstance(x, SomeStrategy)`` (also inside a tuple of classes), and ``getattr(strategy, name, default)`` or
    ``hasattr(strategy, name)`` on an expression that mentions a strategy.
    """
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        if name == "isinstance" and len(args) == 2:
            classes = args[1].elts if isinstance(args[1], ast.Tuple) else [args[1]]
            if any(ast.unparse(cls).endswith("Strategy") for cls in classes):
                yield f"line {node.lineno}: {ast.unparse(node)}"
        probe = (name == "getattr" and len(args) == 3) or (name == "hasattr" and len(args) == 2)
        if probe and "strategy" in ast.unparse(args[0]).lower():
            yield f"line {node.lineno}: {ast.unparse(node)}"


def test_the_shim_asks_strategies_through_the_protocol_only() -> None:
    """No ``isinstance(strategy, <a strategy class>)`` and no ``getattr(strategy, ..., None)`` in the shim (issue 22):
    what the shim needs of a strategy is a member of ``strategies.protocol.ShimStrategy``, which every ``acc_*``
    Fabric strategy implements.
    """
    found = sorted(
        f"{module} {probe}"
        for module, path in _modules().items()
        if module.count(".") and _layer(module) in SHIM
        for probe in _strategy_probes(ast.parse(path.read_text(encoding="utf-8")))
    )
    assert found == []


def test_the_probe_finder_finds_probes() -> None:
    source = (
        "isinstance(s, (int, FSDPStrategy))\n"
        "getattr(self._strategy, 'fsdp_plugin', None)\n"
        "hasattr(fabric.strategy, 'engine')\n"
        "getattr(model, 'module', model)\n"  # not a strategy: allowed
        "isinstance(precision, AcceleratePrecision)\n"  # not a strategy class: allowed
    )
    assert [probe.split(":")[0] for probe in _strategy_probes(ast.parse(source))] == ["line 1", "line 2", "line 3"]


def test_the_shim_internals_are_used_by_the_shim_only() -> None:
    outside = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.count(".") and _layer(module) not in SHIM
        for target in targets
        if _layer(target) == "_accelerator"
    )
    assert outside == []


_FIELD_CLASSES = ("dataclass", "NamedTuple", "Protocol", "TypedDict")
_PREPARED_LISTS = frozenset({"_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects"})


def _host_declarations(tree: ast.AST) -> Iterator[str]:
    """Where a class declares attributes it expects its host to have: a bare annotation, a ``TYPE_CHECKING`` stub.

    Classes whose annotations are their fields (dataclasses, named tuples, protocols, typed dicts) are exempt.
    """
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        marks = [ast.unparse(d) for d in node.decorator_list] + [ast.unparse(b) for b in node.bases]
        if any(mark.split("(")[0].rsplit(".", 1)[-1] in _FIELD_CLASSES for mark in marks):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and item.value is None:
                yield f"{node.name} line {item.lineno}: {ast.unparse(item)}"
            if isinstance(item, ast.If) and "TYPE_CHECKING" in ast.unparse(item.test):
                yield f"{node.name} line {item.lineno}: a TYPE_CHECKING block"


def _prepared_list_reads(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _PREPARED_LISTS:
            yield f"line {node.lineno}: {ast.unparse(node)}"


def _shim_sources() -> Iterator[tuple[str, ast.AST]]:
    for module, path in _modules().items():
        if module.count(".") and _layer(module) in ("accelerator", "_accelerator"):
            yield module, ast.parse(path.read_text(encoding="utf-8"))


def test_the_accelerator_collaborators_take_their_state_explicitly() -> None:
    """The ``Accelerator`` and its collaborators declare no attribute of a host (issue 34): each collaborator gets
    what it reads as constructor arguments, and the prepared objects are read through ``PreparedObjects`` only (the
    ``Accelerator``'s read-only ``_models``-style properties exist for Accelerate's tests and are defined, not read).
    """
    declared = sorted(f"{module} {found}" for module, tree in _shim_sources() for found in _host_declarations(tree))
    assert declared == []
    reads = sorted(f"{module} {found}" for module, tree in _shim_sources() for found in _prepared_list_reads(tree))
    assert reads == []


def test_the_collaborator_rules_find_what_they_forbid() -> None:
    source = (
        "class Mixin:\n    fabric: Fabric\n    if TYPE_CHECKING:\n        def save(self) -> None: ...\n"
        "@dataclass\nclass Fields:\n    models: list[int]\n"  # a dataclass's fields: allowed
        "class Owner:\n    limit: int = 3\n"  # a class attribute with a value: allowed
        "x = self._models\n"
    )
    tree = ast.parse(source)
    assert [found.split(":")[0] for found in _host_declarations(tree)] == ["Mixin line 2", "Mixin line 3"]
    assert [found.split(":")[0] for found in _prepared_list_reads(tree)] == ["line 10"]


# Modules of utils/ that accelerate.utils does not have, waiting for their place (issue 22). Empty: keep it so.
UTILS_NOT_YET_PLACED: frozenset[str] = frozenset()


def test_utils_holds_accelerate_module_names_only() -> None:
    names = {path.stem if path.is_file() else path.name for path in (PACKAGE / "utils").iterdir()}
    extra = sorted(name for name in names - ACCELERATE_UTILS_MODULES - UTILS_NOT_YET_PLACED - {"__pycache__"})
    assert extra == [], f"not a module of accelerate.utils 1.15; move it next to its one user: {extra}"
    placed = sorted(UTILS_NOT_YET_PLACED - names)
    assert placed == [], f"{placed} left utils/: drop them from UTILS_NOT_YET_PLACED"


def test_at_most_one_private_module_at_the_package_root() -> None:
    private = sorted(
        path.name
        for path in PACKAGE.iterdir()
        if path.name.startswith("_") and path.name not in {"__init__.py", "__pycache__", "__main__.py"}
    )
    assert len(private) <= 1, private


def test_the_graph_sees_every_kind_of_import() -> None:
    """Guard against a reader that finds nothing: a known edge of each kind is present."""
    graph = _graph()
    assert "lightning_accel._accelerator.fabric" in graph["lightning_accel.accelerator"]  # module level
    assert "lightning_accel.config.devices" in graph["lightning_accel.state"]  # lazy, inside a method
    assert "lightning_accel.config" in graph["lightning_accel.state"]  # the package run before its module
    assert "lightning_accel.config.file" in graph["lightning_accel.strategies.from_settings"]  # under TYPE_CHECKING
    assert "lightning_accel.strategies.registry" in graph["lightning_accel.strategies.from_settings"]


def test_the_circle_finder_finds_a_circle(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = "lightning_accel.a", "lightning_accel.b", "lightning_accel.c"
    graph = {a: frozenset({b}), b: frozenset({a, c}), c: frozenset()}
    monkeypatch.setattr(f"{__name__}._graph", lambda: graph)
    assert _circles() == [[a, b]]
