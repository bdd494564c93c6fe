"""Lightning's private members are used only through ``lightning_accel.lightning_compat``.

The scan reads the package's source: a private member of a Lightning base class that one of our classes overrides or
calls must be declared with ``lightning_private_members`` (checked when the class is defined), a private attribute of
a Lightning object must be read with ``lightning_private`` and written with ``set_lightning_private``, and a private
name imported from Lightning must exist. Then the checks themselves are shown to raise, naming the member and the
installed Lightning version, on real Lightning classes that lack the member.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import lightning
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy

import lightning_accel
from lightning_accel.lightning_compat import (
    declared_lightning_privates,
    lightning_private,
    lightning_private_members,
    set_lightning_private,
)

PACKAGE = Path(lightning_accel.__file__).resolve().parent
LIGHTNING = Path(lightning.__file__).resolve().parent
_ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")

# Uses the scan cannot tell from Lightning's, each with why it is not a private Lightning member, or which session
# owns the file that still uses one directly. Keyed by (file under lightning_accel/, member).
ALLOWED = {
    ("optimizer.py", "_optimizer"): "a probe of any wrapper; Lightning's answer by their public .optimizer first",
    # A file another session is changing: it still uses a Lightning member directly (to move to the check).
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _from_lightning(cls: type) -> bool:
    return cls.__module__.partition(".")[0] == "lightning"


def _from_package(cls: type) -> bool:
    return cls.__module__.partition(".")[0] == "lightning_accel"


def _self_stores(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


@cache
def _lightning_private_names() -> frozenset[str]:
    """Every private name Lightning's source defines: module and class members, and attributes set on ``self``."""
    names: set[str] = set()
    for path in LIGHTNING.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bodies = [tree.body, *(node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]
        for body in bodies:
            for item in body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(item.name)
                elif isinstance(item, ast.Assign | ast.AnnAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
        names |= _self_stores(tree)
    return frozenset(name for name in names if _is_private(name)) - _torch_private_names()


@cache
def _torch_private_names() -> frozenset[str]:
    """Private members of torch's modules and optimizers (torch's, not Lightning's, when Lightning shares one)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    return frozenset({*dir(torch.nn.Module), *vars(torch.nn.Module()), *dir(torch.optim.Optimizer), *vars(optimizer)})


@cache
def _package_classes() -> tuple[type, ...]:
    """Every class defined in the package (all its modules imported)."""
    modules = [importlib.import_module(info.name) for info in pkgutil.walk_packages([str(PACKAGE)], "lightning_accel.")]
    return tuple(
        obj
        for module in [lightning_accel, *modules]
        for obj in vars(module).values()
        if inspect.isclass(obj) and obj.__module__ == module.__name__
    )


@cache
def _lightning_instance_attributes(cls: type) -> frozenset[str]:
    try:
        return frozenset(_self_stores(ast.parse(textwrap.dedent(inspect.getsource(cls)))))
    except (OSError, TypeError):  # a class without source (built in C)
        return frozenset()


def _private_uses_in_class(cls: type) -> Iterator[tuple[str, str]]:
    """``(name, how)`` for each private method ``cls`` defines and each ``self._x`` / ``super()._x`` in its body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    for item in body.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(item.name):
            yield item.name, f"def {item.name}"
    for node in ast.walk(body):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or ast.unparse(owner) == "super()":
            yield node.attr, ast.unparse(node)


def _relative(cls: type) -> str:
    path = Path(inspect.getfile(cls)).resolve()
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name


def base_class_violations(cls: type, ours: Callable[[type], bool] = _from_package) -> list[str]:
    """The private Lightning members ``cls`` (through its own bases, those ``ours`` accepts) uses without the check."""
    bases = [base for base in cls.__mro__ if _from_lightning(base)]
    if not bases:
        return []
    members = set().union(*(vars(base) for base in bases))
    attributes = set().union(*(_lightning_instance_attributes(base) for base in bases))
    declared = declared_lightning_privates(cls)
    found = []
    for own in (k for k in cls.__mro__ if ours(k)):
        for name, how in _private_uses_in_class(own):
            where = f"{_relative(own)}: {cls.__name__} ({own.__name__}) {how}"
            if (_relative(own), name) in ALLOWED:
                continue
            if name in members and name not in declared:
                found.append(f"{where}: declare it with @lightning_private_members({name!r})")
            elif name not in members and name in attributes:
                found.append(f"{where}: use lightning_private / set_lightning_private for {name!r}")
    return found


def object_violations(path: Path, root: Path = PACKAGE) -> list[str]:
    """``obj._x`` and ``getattr(obj, "_x")`` in ``path`` where ``_x`` is a private Lightning name (``obj`` not self)."""
    relative = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or ast.unparse(owner) == "super()":
                continue  # members of the class itself: base_class_violations reads those with the class's bases
            used = ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ACCESSORS:
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                continue
            name, used = str(node.args[1].value), ast.unparse(node)
        else:
            continue
        if name in _lightning_private_names() and (relative, name) not in ALLOWED:
            found.append(f"{relative}:{node.lineno}: {used}: use lightning_private / set_lightning_private")
    return found


def _private_lightning_imports() -> Iterator[tuple[str, str, str]]:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] == "lightning":
                for alias in node.names:
                    if _is_private(alias.name):
                        yield f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}", str(node.module), alias.name


def test_private_members_of_lightning_base_classes_are_checked() -> None:
    classes = [cls for cls in _package_classes() if any(_from_lightning(base) for base in cls.__mro__)]
    assert len(classes) > 20  # the strategies, precision plugins, callbacks, wrappers
    assert sorted({v for cls in classes for v in base_class_violations(cls)}) == []


def test_private_members_of_lightning_objects_are_checked() -> None:
    assert sorted(v for path in PACKAGE.rglob("*.py") for v in object_violations(path)) == []


def test_private_lightning_imports_exist() -> None:
    """Function-level ones too, which would otherwise fail only when the function runs."""
    missing = [
        f"{where}: {module}.{name}"
        for where, module, name in _private_lightning_imports()
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []


def test_allowed_entries_are_still_used() -> None:
    used = {
        (path.relative_to(PACKAGE).as_posix(), name)
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        for name in [node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)]
        if isinstance(node, ast.Attribute | ast.Constant)
    }
    assert set(ALLOWED) - used == set(), "no longer used: remove these entries from ALLOWED"


def test_the_scan_finds_an_unchecked_override_and_attribute() -> None:
    class Unchecked(FabricDDPStrategy):
        def _configure_launcher(self) -> None:
            self._launcher = None

    @lightning_private_members("_configure_launcher")
    class Checked(FabricDDPStrategy):
        def _configure_launcher(self) -> None:
            set_lightning_private(self, "_launcher", None)

    def from_here(cls: type) -> bool:
        return cls.__module__ == __name__

    violations = base_class_violations(Unchecked, ours=from_here)
    assert len(violations) == 2
    assert "@lightning_private_members('_configure_launcher')" in violations[0]
    assert "self._launcher" in violations[1] and "set_lightning_private" in violations[1]
    assert base_class_violations(Checked, ours=from_here) == []


def test_the_scan_finds_an_unchecked_private_read_on_another_object(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(trainer):\n    return trainer._checkpoint_connector, getattr(trainer, '_accelerator_connector')\n"
    )
    violations = object_violations(source, root=tmp_path)
    assert [v.split(": ")[1] for v in violations] == [
        "trainer._checkpoint_connector",
        "getattr(trainer, '_accelerator_connector')",
    ]


def _without(base: type, name: str) -> type:
    """A copy of the Lightning class ``base`` (same module, same bases) as a release that renamed ``name`` has it."""
    namespace = {k: v for k, v in vars(base).items() if k not in (name, "__dict__", "__weakref__")}
    namespace[f"{name}_renamed"] = vars(base)[name]
    return type(base.__name__, base.__bases__, namespace)


def test_an_override_of_a_renamed_private_method_fails_at_class_definition() -> None:
    renamed = _without(FabricDDPStrategy, "_determine_ddp_device_ids")
    assert renamed.__module__ == "lightning.fabric.strategies.ddp"
    with pytest.raises(RuntimeError, match=rf"_determine_ddp_device_ids.*lightning=={lightning.__version__}"):

        @lightning_private_members("_determine_ddp_device_ids")
        class Strategy(renamed):  # type: ignore[misc,valid-type]
            def _determine_ddp_device_ids(self) -> None:
                return None


def test_our_strategies_declarations_fail_when_lightning_lacks_a_member(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel.strategies.ddp import FabricAcceleratedDDPStrategy

    declared = declared_lightning_privates(FabricAcceleratedDDPStrategy)
    assert "_determine_ddp_device_ids" in declared
    lightning_private_members(*declared)(FabricAcceleratedDDPStrategy)  # the installed Lightning has them all
    monkeypatch.delattr(FabricDDPStrategy, "_determine_ddp_device_ids")
    with pytest.raises(RuntimeError, match=rf"FabricAcceleratedDDPStrategy.*lightning=={lightning.__version__}"):
        lightning_private_members(*declared)(FabricAcceleratedDDPStrategy)


def test_reading_and_writing_a_missing_private_attribute_names_the_version() -> None:
    class Strategy(FabricSingleDeviceStrategy):
        """A real Lightning strategy whose ``_root_device`` a future release renamed."""

        def __init__(self) -> None:
            super().__init__(device="cpu")
            self._root_device_renamed = vars(self).pop("_root_device")

    strategy = Strategy()
    version = rf"lightning=={lightning.__version__}"
    with pytest.raises(RuntimeError, match=rf"Strategy\._root_device, a private member.*{version}"):
        lightning_private(strategy, "_root_device")
    with pytest.raises(RuntimeError, match=rf"Strategy\._root_device, a private member.*{version}"):
        set_lightning_private(strategy, "_root_device", torch.device("cpu"))
    assert "_root_device" not in vars(strategy)  # nothing written that Lightning would not read
    plain = FabricSingleDeviceStrategy(device="cpu")
    set_lightning_private(plain, "_root_device", torch.device("meta"))
    assert plain.root_device == torch.device("meta")


def test_the_decorator_refuses_public_names_and_classes_without_a_lightning_base() -> None:
    with pytest.raises(TypeError, match="private members"):
        lightning_private_members("setup")
    with pytest.raises(TypeError, match="no Lightning base class"):
        lightning_private_members("_x")(type("Plain", (), {}))


def test_our_strategy_fails_clearly_where_lightning_no_longer_has_an_attribute_it_writes() -> None:
    from lightning_accel.strategies.single_device import FabricAcceleratedSingleDeviceStrategy

    strategy = FabricAcceleratedSingleDeviceStrategy()
    vars(strategy).pop("_root_device")  # as a Lightning release that renamed it would leave the strategy
    with pytest.raises(
        RuntimeError, match=rf"FabricAcceleratedSingleDeviceStrategy\._root_device.*lightning=={lightning.__version__}"
    ):
        strategy._configure_launcher()
    assert "_root_device" not in vars(strategy)
