"""The package's own promises: no torch in core deps, every console script resolves, docs current."""

from __future__ import annotations

import importlib
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from tests.conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_torch_is_not_a_core_dependency():
    names = [
        d.split("[")[0].split(">")[0].split("=")[0].strip().lower() for d in PROJECT["dependencies"]
    ]
    assert "torch" not in names
    assert (
        subprocess.run(
            [sys.executable, str(ROOT / "scripts/check_no_torch.py")], cwd=ROOT
        ).returncode
        == 0
    )


@pytest.mark.parametrize("script", sorted(PROJECT["scripts"]))
def test_console_script_target_is_importable(script):
    module_name, func = PROJECT["scripts"][script].split(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, func)), f"{script} -> {module_name}:{func} is not callable"


def test_config_md_is_generated_from_the_models():
    fresh = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_config_md.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (ROOT / "CONFIG.md").read_text() == fresh, "CONFIG.md is stale: run `make config-docs`"
