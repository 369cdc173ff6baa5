"""Every command block of README.md and environments/README.md runs as written, against real
processes (the tiny model behind ``atropos-serve-model``, the environments, ``view-run``);
blocks that need the internet, a GPU or minutes carry a visible ``docs-test: skip`` marker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT
from tests.docs.runner import DocRun, iter_shell_blocks, parse_blocks

PAGES = [ROOT / "README.md", ROOT / "environments" / "README.md"]


def _workdir(tmp_path: Path) -> Path:
    """A directory that looks like the checkout's root to the documented commands.

    Only what they read is linked in: the environments, the trainer's configs and the
    venv's ``activate`` script. No Makefile or pyproject.toml, so a command that would
    install or rebuild (a missing skip marker on ``make``) fails here instead of touching
    the shared virtual environment.
    """
    work = tmp_path / "checkout"
    (work / ".venv" / "bin").mkdir(parents=True)
    os.symlink(ROOT / ".venv" / "bin" / "activate", work / ".venv" / "bin" / "activate")
    for name in ("environments", "example_trainer"):
        os.symlink(ROOT / name, work / name)
    return work


def test_readme_commands_run_as_written(tmp_path):
    with DocRun(_workdir(tmp_path), timeout=180) as run:
        run.run_page(ROOT / "README.md")
        groups = [json.loads(line) for line in (run.workdir / "rollouts.jsonl").open()]
        assert len(groups) == 2 and all(len(g["scores"]) == 4 for g in groups)
        page = httpx.get(f"http://127.0.0.1:{run.ports[7860]}/", timeout=30)
        assert page.status_code == 200 and "gradio" in page.text.lower()
    assert any("needs the internet" in s for s in run.skipped), run.skipped
    assert len(run.ran) >= 4


def test_environments_readme_commands_run_as_written(tmp_path):
    with DocRun(_workdir(tmp_path), timeout=180) as run:
        run.run_page(ROOT / "environments" / "README.md")
    assert len(run.ran) >= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_skipped_block_says_why(page):
    for block in iter_shell_blocks(page):
        if block.kind == "skip":
            assert len(block.arg.split()) >= 3, f"{block.where}: say why it is not run"
        assert block.kind in (None, "skip", "background"), block.where


def test_an_unmarked_block_that_fails_fails_the_test(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Fine:\n\n```bash\nX=1\n```\n\n"
        'Needs the network:\n\n```bash\ntest "$X" = 1 && exit 3\n```\n'
    )
    with DocRun(tmp_path / "w", timeout=30) as run, pytest.raises(AssertionError, match=":9: exit"):
        run.run_page(page)
    page.write_text("<!-- docs-test: skip -->\n```bash\nfalse\n```\n")
    with pytest.raises(ValueError, match="needs an argument"):
        parse_blocks(page)
    page.write_text("<!-- docs-test: sometimes x -->\n```bash\nfalse\n```\n")
    with pytest.raises(ValueError, match="malformed marker"):
        parse_blocks(page)


def test_documented_ports_are_mapped_and_bare_servers_get_one(tmp_path):
    run = DocRun(tmp_path, ports={8000: 18000, 9001: 19001, 7860: 17860})
    text = run.rewrite(
        "run-api   # on :8000\natropos-serve-model M --port 9001\nview-run --file r.jsonl\n"
        "curl http://127.0.0.1:9001/v1 # not 90011\n"
    )
    assert text.splitlines() == [
        "run-api --port 18000   # on :18000",
        "atropos-serve-model M --port 19001",
        "view-run --port 17860 --file r.jsonl",
        "curl http://127.0.0.1:19001/v1 # not 90011",
    ]
