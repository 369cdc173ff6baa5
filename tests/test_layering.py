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
    "sandbox": {"utils", "http"},
    "envs": {"utils", "http", "type_definitions"},
    "proxy": {"utils", "http", "envs"},
    "frontend": {"utils", "http", "api", "envs", "type_definitions"},
    "cli": {
        "utils",
        "http",
        "api",
        "serving",
        "sandbox",
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
        "sandbox",
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


# --- import cycles -------------------------------------------------------------------------
# A module-level import cycle inside a package makes import order matter: whichever module is
# imported first sees the other half-built. Imports inside functions and under
# ``if TYPE_CHECKING:`` run later or never, so they are not edges.

CYCLE_ROOTS = ("atroposlib", "example_trainer", "environments")

# Module-level cycles that exist today, each named, to be dissolved (then removed from here).
# A new cycle fails the test; so does an entry whose cycle is gone or has changed.
KNOWN_CYCLES: dict[str, frozenset[str]] = {}

# Cycles closed only by an import inside a function (deferred to dodge the import-order
# problem, not dissolved): the same rules, so the list only shrinks.
DEFERRED_CYCLES: dict[str, frozenset[str]] = {}


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(
    tree: ast.Module, in_functions: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: at top level or in a class, try,
    with, for or plain ``if`` body; not only under ``if TYPE_CHECKING:`` (its ``else:`` does
    run); in a function only with ``in_functions``."""
    found: list[ast.Import | ast.ImportFrom] = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def walk(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, functions) and not in_functions:
                continue
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse)
            else:
                walk(ast.iter_child_nodes(node))

    walk(tree.body)
    return found


def import_graph(
    base: Path, roots: tuple[str, ...], in_functions: bool = False
) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same root -> line}, over the packages ``roots``
    under ``base``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
    else to ``pkg``; relative imports are resolved. ``in_functions`` adds the imports inside
    functions."""
    files = {
        _module_name(path, base): path for root in roots for path in (base / root).rglob("*.py")
    }
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _import_time_imports(tree, in_functions):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    anchor = module.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    source = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in files:  # import a.b.c where only a.b is ours
                    target = target.rpartition(".")[0]
                same_root = target.split(".")[0] == module.split(".")[0]
                if target and target != module and same_root:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe_cycle(graph: dict[str, dict[str, int]], component: frozenset[str]) -> str:
    """One shortest cycle through the component's first module, each arrow with its line."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                path = paths[node] + [start]
                return (
                    " -> ".join(
                        f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:], strict=False)
                    )
                    + f" -> {start}"
                )
            if child in component and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _cycle_report(
    graph, components, known: dict[str, frozenset[str]], listed_in: str = "KNOWN_CYCLES"
) -> list[str]:
    problems = []
    for component in components:
        if component not in known.values():
            problems.append(
                f"new import cycle among {sorted(component)}:\n    "
                + describe_cycle(graph, component)
            )
    for name, members in known.items():
        if members not in components:
            problems.append(f"{listed_in}[{name!r}] is no longer a cycle as listed: update it")
    return problems


def test_no_new_module_level_import_cycles():
    graph = import_graph(ROOT, CYCLE_ROOTS)
    problems = _cycle_report(graph, strongly_connected(graph), KNOWN_CYCLES)
    assert not problems, "\n".join(problems)


def test_no_new_cycles_through_imports_inside_functions():
    """Moving an import into a function hides a cycle from the import order, not from the
    design: those cycles are listed too, and the list only shrinks."""
    graph = import_graph(ROOT, CYCLE_ROOTS, in_functions=True)
    cycles = [c for c in strongly_connected(graph) if c not in KNOWN_CYCLES.values()]
    problems = _cycle_report(graph, cycles, DEFERRED_CYCLES, "DEFERRED_CYCLES")
    assert not problems, "\n".join(problems)


def _write_package(base: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_detector_on_a_synthetic_package(tmp_path):
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import A\n",
            "pkg/a.py": "from pkg import b\nA = 1\n",
            "pkg/b.py": "import os\n\nfrom . import c\n",
            "pkg/c.py": "from pkg.a import A\n",
            # only types, or only at call time: no edges
            "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
            "pkg/e.py": "def f():\n    from pkg import d\n",
            "pkg/f.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import pkg.g\n",
            "pkg/g.py": "class G:\n    from pkg.f import x\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/h.py": "from ..sub import i\n",
            "pkg/sub/i.py": "from .h import *\n",
            "other/__init__.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, ("pkg", "other"))
    assert graph["pkg.d"] == {} and graph["pkg.e"] == {}
    deferred = import_graph(tmp_path, ("pkg", "other"), in_functions=True)
    assert deferred["pkg.e"] == {"pkg.d": 2} and deferred["pkg.d"] == {}
    assert frozenset({"pkg.d", "pkg.e"}) not in strongly_connected(deferred)
    assert graph["other"] == {}  # another root: the layering test's business
    components = strongly_connected(graph)
    assert set(components) == {
        frozenset({"pkg.a", "pkg.b", "pkg.c"}),
        frozenset({"pkg.f", "pkg.g"}),
        frozenset({"pkg.sub.h", "pkg.sub.i"}),
    }
    cycle = describe_cycle(graph, frozenset({"pkg.a", "pkg.b", "pkg.c"}))
    assert cycle == "pkg.a (line 1) -> pkg.b (line 3) -> pkg.c (line 1) -> pkg.a"
    known = {"a-b-c": frozenset({"pkg.a", "pkg.b", "pkg.c"}), "gone": frozenset({"pkg.x", "pkg.y"})}
    problems = _cycle_report(graph, components, known)
    assert len(problems) == 3
    assert problems[0].startswith("new import cycle among ['pkg.f', 'pkg.g']")
    assert "KNOWN_CYCLES['gone'] is no longer a cycle" in problems[2]


# Test folders that exercise several packages together rather than one.
# real_model: the real pretrained model through serving, the client and the trainer.
CROSS_CUTTING_TEST_DIRS = {"compat", "docs", "multinode", "real_model", "routers", "slurm", "vllm"}


def test_test_folders_are_named_after_the_packages_they_test():
    """``tests/<name>/`` mirrors a package: a sub-package of ``atroposlib`` (or of
    ``atroposlib.envs``), ``example_trainer`` or ``environments``; the few cross-cutting
    folders are listed above."""
    root = Path(__file__).resolve().parent
    repo = root.parent
    packages = {p.name for p in (repo / "atroposlib").iterdir() if (p / "__init__.py").exists()}
    packages |= {
        p.name for p in (repo / "atroposlib" / "envs").iterdir() if (p / "__init__.py").exists()
    }
    packages |= {"example_trainer", "environments"}
    folders = {
        d.name
        for d in root.iterdir()
        if d.is_dir() and any(d.glob("test_*.py")) and not d.name.startswith((".", "_"))
    }
    strays = sorted(folders - packages - CROSS_CUTTING_TEST_DIRS)
    assert not strays, f"test folders named after no package: {strays}"
