"""The house's layering: which package may import which (CONTRIBUTING.md, "The house").

Every ``import atroposlib.X`` / ``from atroposlib.X ...`` in the product, including imports
inside functions, is checked against :data:`MAY_IMPORT`. A new arrow either belongs to the
design (add it here and to CONTRIBUTING.md's map in the same change) or is a layering bug.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "atroposlib"

# package -> the atroposlib packages its modules may import (itself always allowed).
# ``type_definitions`` is a leaf module of shared TypedDicts.
MAY_IMPORT: dict[str, set[str]] = {
    "type_definitions": set(),
    "utils": set(),
    "http": {"utils"},
    "tiny_model": {"utils"},
    "api": {"utils", "http"},
    "serving": {"utils", "http"},
    "envs": {"utils", "http", "type_definitions"},
    "proxy": {"utils", "http", "envs"},
    "frontend": {"utils", "http", "api", "envs", "type_definitions"},
    "cli": {
        "utils",
        "http",
        "api",
        "serving",
        "envs",
        "proxy",
        "frontend",
        "tiny_model",
        "type_definitions",
    },
    # The test doubles may use anything in the product; nothing in the product uses them.
    "testing": {
        "utils",
        "http",
        "api",
        "serving",
        "envs",
        "proxy",
        "frontend",
        "cli",
        "tiny_model",
        "type_definitions",
    },
}

# The original's import paths of code that moved up a floor: each only re-exports the names
# the original had there (checked below), so the arrow up carries no logic.
COMPATIBILITY_PATHS: dict[str, set[str]] = {
    "atroposlib/envs/server_handling/managed_server_proxy.py": {"proxy", "cli"},
}

# Code outside the package that ships to users must not depend on the test doubles either.
PRODUCT_OUTSIDE_PACKAGE = ("example_trainer", "environments")


def _package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def _atroposlib_imports(path: Path) -> list[tuple[int, str]]:
    """(line, first component after ``atroposlib.``) for every atroposlib import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "atroposlib":  # from atroposlib import envs
                names = [f"atroposlib.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "atroposlib" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue  # the top-level package re-exports the public surface
        owner = _package_of(path)
        allowed = MAY_IMPORT.get(owner)
        if allowed is not None:
            allowed = allowed | COMPATIBILITY_PATHS.get(str(path.relative_to(ROOT)), set())
        if allowed is None:
            bad.append(f"{path.relative_to(ROOT)}: package {owner!r} is not in the layering map")
            continue
        for line, target in _atroposlib_imports(path):
            if target != owner and target not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {owner} -> {target}")
    return bad


def test_every_package_imports_only_the_layers_below_it():
    bad = _violations()
    assert not bad, "imports that break the layering:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", sorted(COMPATIBILITY_PATHS))
def test_a_compatibility_path_only_re_exports(path):
    """No function or class is defined in a module kept only for the original's import path:
    its logic lives in the package it re-exports."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    defined = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    assert not defined, f"{path} defines {defined}: move them to the package it re-exports"


@pytest.mark.parametrize("top", PRODUCT_OUTSIDE_PACKAGE)
def test_shipped_code_never_imports_the_test_doubles(top):
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / top).rglob("*.py"))
        for line, target in _atroposlib_imports(path)
        if target == "testing"
    ]
    assert not bad, "shipped code imports atroposlib.testing:\n" + "\n".join(bad)


def test_every_package_is_on_the_contributing_map():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    missing = [name for name in MAY_IMPORT if f"`{name}" not in text]
    assert not missing, f"CONTRIBUTING.md's map does not list: {missing}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "def f():\n    from atroposlib.envs import base\n    import atroposlib.api.store\n"
    )
    assert [target for _, target in _atroposlib_imports(source)] == ["envs", "api"]
