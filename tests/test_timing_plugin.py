"""The per-file time report and the default tier's budget (tests/_timing.py), run in pytester."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TWO_FILES = {
    "test_fast": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
    "test_slow": (
        "import time, pytest\n\n"
        "@pytest.fixture\n"
        "def slow_setup():\n    time.sleep(0.2)\n    yield\n    time.sleep(0.1)\n\n"
        "def test_c(slow_setup):\n    time.sleep(0.1)\n"
    ),
}


INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch) -> pytest.Pytester:
    monkeypatch.delenv("ATROPOS_TEST_BUDGET_S", raising=False)
    pytester.makepyfile(**TWO_FILES)
    pytester.makeini(INI)
    return pytester


def test_each_file_s_setup_call_and_teardown_are_summed_and_written(project):
    result = project.runpytest("-p", "tests._timing", "--file-times=times.json")
    result.assert_outcomes(passed=3)
    report = json.loads((project.path / "times.json").read_text())
    files = {entry["path"]: entry for entry in report["files"]}
    assert [entry["path"] for entry in report["files"]] == ["test_slow.py", "test_fast.py"]
    assert files["test_slow.py"]["seconds"] >= 0.4  # 0.2 setup + 0.1 call + 0.1 teardown
    assert files["test_slow.py"]["tests"] == 1 and files["test_fast.py"]["tests"] == 2
    assert report["wall_s"] >= files["test_slow.py"]["seconds"]
    result.stdout.fnmatch_lines(["*slowest 15 test files*", "*1 tests  test_slow.py"])


def test_a_session_over_its_budget_fails_naming_the_slowest_files(project):
    project.makeini(INI + "time_budget_s = 0.2\n")
    result = project.runpytest("-p", "tests._timing", "--file-times=", "--budget")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*time budget exceeded*", "*over its budget of 0s*", "*s  test_slow.py"]
    )
    assert not (project.path / ".cache").exists()


def test_the_environment_raises_the_budget(project, monkeypatch):
    project.makeini(INI + "time_budget_s = 0.2\n")
    monkeypatch.setenv("ATROPOS_TEST_BUDGET_S", "600")
    result = project.runpytest("-p", "tests._timing", "--budget")
    assert result.ret == pytest.ExitCode.OK
    assert "time budget exceeded" not in result.stdout.str()


def test_without_budget_flag_a_long_session_passes(project):
    project.makeini(INI + "time_budget_s = 0.2\n")
    assert project.runpytest("-p", "tests._timing").ret == pytest.ExitCode.OK


def test_a_bad_budget_is_a_usage_error_naming_the_setting(project, monkeypatch):
    monkeypatch.setenv("ATROPOS_TEST_BUDGET_S", "eight minutes")
    result = project.runpytest("-p", "tests._timing", "--budget")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ATROPOS_TEST_BUDGET_S / time_budget_s*'eight minutes'*"])


def test_under_two_xdist_workers_the_controller_sums_writes_and_judges(project, monkeypatch):
    """`make test` runs the default tier on pytest-xdist workers: their reports reach the
    controller, which alone writes every file's time and fails a session over its budget."""
    root = Path(__file__).resolve().parents[1]
    paths = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    project.makeini(INI + "time_budget_s = 0.2\n")
    result = project.runpytest_subprocess(
        "-p", "tests._timing", "-n", "2", "--file-times=times.json", "--budget"
    )
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*2 workers*", "*time budget exceeded*", "*s  test_slow.py"])
    report = json.loads((project.path / "times.json").read_text())
    files = {entry["path"]: entry for entry in report["files"]}
    assert files["test_slow.py"]["seconds"] >= 0.4 and files["test_fast.py"]["tests"] == 2
