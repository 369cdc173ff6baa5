"""Supported dependency ranges: declared once, locked, and enforced at start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from atroposlib.utils.dependencies import declared_ranges, problems

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from dependency_bounds import direct_requirements, lower_bound  # noqa: E402


def test_an_out_of_range_version_is_one_line_naming_package_version_and_range(monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "4.40.0" if name == "transformers" else real(name)
    )
    ranges = {"transformers": Requirement("transformers>=4.57.6")}
    (line,) = problems(["transformers", "not-installed-anywhere"], ranges)
    assert "transformers 4.40.0" in line and ">=4.57.6" in line
    assert problems(["transformers"], {"transformers": Requirement("transformers>=4.0")}) == []


def test_the_installed_package_declares_the_ranges_of_pyproject():
    declared = declared_ranges()
    for req in direct_requirements():
        if canonicalize_name(req.name) == "editables":
            continue  # an editable install's metadata adds hatchling's own `editables~=0.3`
        assert str(declared[canonicalize_name(req.name)].specifier) == str(req.specifier)


def test_every_direct_dependency_has_a_lower_bound():
    missing = [str(r) for r in direct_requirements() if lower_bound(r) is None]
    assert missing == []


def test_the_lock_pins_every_direct_dependency_inside_its_declared_range():
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, ver = line.partition("==")
            pins[canonicalize_name(name.split("[")[0])] = Version(ver.split(";")[0].strip())
    for req in direct_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not in requirements.lock (run make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])


def _past_the_check(*args, **kwargs):
    raise AssertionError("the command went on past the dependency check")


def _serve_model(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from atroposlib.cli import serve_model

    monkeypatch.setattr(serve_model, "validate", _past_the_check)
    serve_model.main(argv)


def _grpo(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from example_trainer import grpo

    # The signal and parent-death supervision main installs first is a process's own.
    monkeypatch.setattr(grpo.supervision, "install", lambda *a, **k: None)
    monkeypatch.setattr(grpo, "model_problem", _past_the_check)
    grpo.main(argv)


@pytest.mark.smoke
@pytest.mark.parametrize(
    "main, command",
    [
        (_serve_model, ["MODEL"]),
        (_grpo, ["--model-name", "MODEL", "--training-steps", "1"]),
    ],
    ids=["atropos-serve-model", "atropos-grpo"],
)
def test_commands_exit_2_at_start_on_an_unsupported_transformers(
    main, command, tiny_model_dir, monkeypatch, capsys
):
    """The console entries' ``main``, called in-process with transformers' metadata saying
    4.40.0 (the real package still imports): exit 2 with one line, before anything starts."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "4.40.0" if name == "transformers" else real(name)
    )
    argv = [str(tiny_model_dir) if a == "MODEL" else a for a in command]
    with pytest.raises(SystemExit) as exc:
        main(argv, monkeypatch)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    floor = declared_ranges()["transformers"].specifier
    assert "transformers 4.40.0 is installed" in lines[0] and str(floor) in lines[0]
