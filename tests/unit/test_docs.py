"""The documentation site: every public name has an API-reference entry, and ``mkdocs build --strict`` passes.

The reference pages (``docs/reference/*.md``) hold mkdocstrings directives (``::: lightning_accel.utils``). Two checks:

- without mkdocs: every public module has a directive, no directive names a private module, and a directive that
  lists its ``members`` lists every name of the module's ``__all__``;
- with mkdocs installed (the ``docs`` extra): the site builds with ``--strict``, and every name of every public
  module's ``__all__`` has a rendered heading (an HTML ``id`` of ``<module>.<name>``) on a reference page. This is what
  catches a name mkdocstrings cannot see statically (a constant without a docstring that a filter hides, a name
  built at run time).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"

# The public modules whose ``__all__`` the API reference must cover (import paths that stay stable; modules named
# ``_*`` are private and may move). ``strategies.deepspeed``, ``utils.environment``, ``utils.deepspeed`` and
# ``utils.bnb`` are public paths (Accelerate's, or the user guide's) holding names their packages do not re-export.
PUBLIC_MODULES = (
    "lightning_accel",
    "lightning_accel.strategies",
    "lightning_accel.strategies.deepspeed",
    "lightning_accel.precision",
    "lightning_accel.callbacks",
    "lightning_accel.config",
    "lightning_accel.enums",
    "lightning_accel.state",
    "lightning_accel.data_loader",
    "lightning_accel.optimizer",
    "lightning_accel.scheduler",
    "lightning_accel.checkpointing",
    "lightning_accel.logging",
    "lightning_accel.tracking",
    "lightning_accel.utils",
    "lightning_accel.utils.environment",
    "lightning_accel.utils.deepspeed",
    "lightning_accel.utils.bnb",
    "lightning_accel.big_modeling",
    "lightning_accel.hooks",
    "lightning_accel.launchers",
    "lightning_accel.integrations.ray",
    "lightning_accel.local_sgd",
    "lightning_accel.inference",
    "lightning_accel.parallelism_config",
    "lightning_accel.cli",
    "lightning_accel.commands",
)

# Public-looking top-level modules left out of the reference, with the reason. Any other module or package at the top
# level whose name does not start with "_" must be in PUBLIC_MODULES.
NOT_DOCUMENTED = {
    "lightning_accel.integrations": "a namespace that imports none of its modules (no engine needed to import it);"
    " its module lightning_accel.integrations.ray is documented",
    "lightning_accel.accelerator": "its one name, Accelerator, is documented at the top level, where users import it",
    "lightning_accel.lightning_compat": "internal: checked access to Lightning's private members, not a user API",
    "lightning_accel.launch_settings": "the launcher's machinery; its Accelerate names are documented at "
    "lightning_accel.utils.environment, which re-exports them",
    "lightning_accel.checkpoint": "the machinery behind Accelerate's checkpoint names, which are documented at"
    " Accelerate's paths (lightning_accel.checkpointing, lightning_accel.utils) where users import them",
}

_DIRECTIVE = re.compile(r"^::: *(?P<path>[\w.]+) *$")


def _directives(text: str) -> list[tuple[str, dict]]:
    """The ``::: path`` directives of a page with their (indented YAML) options."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if not match:
            continue
        block = []
        for following in lines[index + 1 :]:
            if following.strip() and not following.startswith((" ", "\t")):
                break
            block.append(following)
        config = yaml.safe_load("\n".join(block)) or {}
        found.append((match["path"], config.get("options") or {}))
    return found


def _all_directives() -> list[tuple[str, str, dict]]:
    return [
        (page.name, path, options)
        for page in sorted(REFERENCE.glob("*.md"))
        for path, options in _directives(page.read_text(encoding="utf-8"))
    ]


def _public_names(module: str) -> list[str]:
    names = getattr(importlib.import_module(module), "__all__", None)
    assert names, f"{module} has no __all__: the reference cannot tell its public names"
    return list(names)


def _documented(module: str, directives: list[tuple[str, str, dict]]) -> set[str]:
    """The names of ``module`` the directives document, read from the directives alone."""
    names: set[str] = set()
    for _, path, options in directives:
        if path == module:
            members = options.get("members", True)
            if members is True:  # mkdocstrings renders the module's __all__
                names.update(_public_names(module))
            elif members:
                names.update(members)
        elif path.rpartition(".")[0] == module:
            names.add(path.rpartition(".")[2])
    return names


@pytest.mark.usefixtures("undo_library_side_effects")  # importing every module sets torch's variables
def test_every_top_level_public_module_is_documented_or_excused():
    package = importlib.import_module("lightning_accel")
    found = {f"lightning_accel.{info.name}" for info in pkgutil.iter_modules(package.__path__)}
    public = {name for name in found if not name.rpartition(".")[2].startswith("_")}
    unlisted = sorted(public - set(PUBLIC_MODULES) - set(NOT_DOCUMENTED))
    assert not unlisted, (
        f"public modules neither in the API reference nor excused: {unlisted}; add each to PUBLIC_MODULES in "
        "tests/unit/test_docs.py with a page under docs/reference/ (or to NOT_DOCUMENTED, with the reason)"
    )


def test_directive_parser_reads_members_and_object_paths():
    page = "# x\n\n::: pkg.mod\n    options:\n      members:\n        - a\n        - b\n\ntext\n\n::: pkg.mod.c\n"
    assert _directives(page) == [("pkg.mod", {"members": ["a", "b"]}), ("pkg.mod.c", {})]


def test_no_directive_documents_a_private_module():
    private = [(page, path) for page, path, _ in _all_directives() if any(p.startswith("_") for p in path.split("."))]
    assert not private, f"API reference pages document private paths (they may move): {private}"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_a_directive(module):
    directives = _all_directives()
    assert any(path == module or path.startswith(module + ".") for _, path, _ in directives), (
        f"no page under docs/reference/ has a '::: {module}' directive"
    )
    missing = sorted(set(_public_names(module)) - _documented(module, directives))
    assert not missing, f"{module}.__all__ names missing from the API reference: {missing}"


def _mkdocs_available() -> bool:
    try:
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "griffe")
        )
    except ModuleNotFoundError:  # find_spec("a.b") raises when "a" is missing
        return False


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    if not _mkdocs_available():
        pytest.skip("mkdocs, mkdocs-material or mkdocstrings[python] is not installed (pip install -e '.[docs]')")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "-d", site],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


@pytest.mark.launch
def test_mkdocs_build_strict_passes(built_site):
    assert (built_site / "index.html").is_file()
    assert (built_site / "reference" / "utils" / "index.html").is_file()


@pytest.mark.launch
@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_rendered(built_site, module):
    pages = {page for page, path, _ in _all_directives() if path == module or path.rpartition(".")[0] == module}
    assert pages, f"no reference page documents {module}"
    html = "\n".join(
        (built_site / "reference" / Path(page).stem / "index.html").read_text(encoding="utf-8") for page in pages
    )
    rendered = set(re.findall(r'id="' + re.escape(module) + r'\.([A-Za-z_][A-Za-z0-9_]*)"', html))
    missing = sorted(set(_public_names(module)) - rendered)
    assert not missing, f"{module}.__all__ names without a rendered entry in the API reference: {missing}"
