"""The env modules import without cycles: each alone, and none by importing inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "atroposlib" / "envs"

# BaseEnv and the machinery around it that used to import each other lazily.
LOOP_MODULES = ("base", "cli", "offline", "serve", "runner")


@pytest.mark.parametrize("name", (*LOOP_MODULES, "constants"))
def test_module_imports_alone_in_a_fresh_interpreter(name):
    proc = subprocess.run(
        [sys.executable, "-c", f"import atroposlib.envs.{name}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _function_level_envs_imports(path: Path) -> list[str]:
    """``atroposlib.envs`` imports inside a function or method of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "atroposlib.envs"
            ):
                found.append(f"{path.name}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.name}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("atroposlib.envs")
                ]
    return found


def test_no_module_of_the_loop_imports_env_modules_inside_functions():
    found = [
        hit for name in LOOP_MODULES for hit in _function_level_envs_imports(ENVS / f"{name}.py")
    ]
    assert not found, found


def test_the_scan_sees_an_import_inside_a_method(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "class A:\n    async def f(self):\n        from atroposlib.envs.cli import run_cli\n"
    )
    assert _function_level_envs_imports(source) == ["mod.py:3: from atroposlib.envs.cli"]


def test_namespace_separator_is_defined_in_utils_and_reexported():
    from atroposlib.envs import constants
    from atroposlib.utils import cli

    assert constants.NAMESPACE_SEP == cli.NAMESPACE_SEP == "."
