"""README.md is a front door: short, every page it points to exists, its commands work pasted
into a new terminal, and no table in it or in docs/ hides prose in a cell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs.runner import SHELL_LANGS, parse_blocks

README = ROOT / "README.md"
MAX_README_LINES = 200
MAX_CELL_WORDS = 60
TABLE_PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
MOVED = ("performance", "reliability", "async-rl", "differences", "install")
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", re.M)
_USE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def table_cells(text: str) -> list[tuple[int, str]]:
    """``(line, cell)`` for every cell of every markdown table row (separator rows skipped)."""
    cells = []
    for number, line in enumerate(text.splitlines(), 1):
        row = line.strip()
        if not (row.startswith("|") and row.endswith("|") and len(row) > 1):
            continue
        if re.fullmatch(r"\|[\s:|-]+\|", row):
            continue
        cells.extend((number, cell.strip()) for cell in re.split(r"(?<!\\)\|", row[1:-1]))
    return cells


def test_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("page", TABLE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_table_cell_is_over_60_words(page):
    long = [
        f"{page.name}:{line}: {len(cell.split())} words: {cell[:60]}..."
        for line, cell in table_cells(page.read_text())
        if len(cell.split()) > MAX_CELL_WORDS
    ]
    assert not long, "move the prose out of the table:\n" + "\n".join(long)


def test_the_cell_counter_sees_a_long_cell_and_skips_separators():
    text = "| a | b |\n|---|:---:|\n| x | " + "word " * 61 + "|\nnot | a table\n"
    assert [(n, len(c.split())) for n, c in table_cells(text)] == [(1, 1), (1, 1), (3, 1), (3, 61)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file, or whose ``#anchor`` in a markdown file, is missing."""
    broken = []
    for match in _LINK.finditer(page.read_text()):
        target, anchor = match.group(1), match.group(2)
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve()
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
            if anchor[1:] not in {_slug(h) for h in headings}:
                broken.append(target + anchor)
    for anchor in re.findall(r"\]\((#[^)\s]+)\)", page.read_text()):
        headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
        if anchor[1:] not in {_slug(h) for h in headings}:
            broken.append(anchor)
    return broken


@pytest.mark.parametrize(
    "page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_links_resolve(page):
    broken = _broken_links(page)
    assert not broken, f"{page.name} links to missing files or headings: {broken}"


def test_the_link_check_sees_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## The vLLM server\n[a](#the-vllm-server) [b](#gone) [c](nope.md)\n")
    assert _broken_links(page) == ["nope.md", "#gone"]


def test_readme_indexes_the_moved_pages():
    text = README.read_text()
    for name in MOVED:
        assert f"](docs/{name}.md)" in text, f"README.md's docs index lacks docs/{name}.md"


def _unset_variables(block_text: str) -> set[str]:
    used = set(_USE.findall(block_text))
    return used - set(_ASSIGN.findall(block_text)) - {"PATH", "HOME", "PWD"}


def _new_terminal_blocks(page: Path) -> list:
    """Shell blocks the prose just before them sends to another terminal."""
    lines = page.read_text().splitlines()
    found, previous_end = [], 0
    for block in parse_blocks(page):
        prose = " ".join(lines[previous_end : block.line - 1]).lower()
        if block.lang in SHELL_LANGS and "terminal" in prose:
            found.append(block)
        previous_end = block.line + block.text.count("\n")
    return found


def test_a_block_for_a_new_terminal_sets_what_it_uses():
    """A new terminal sees nothing an earlier block set: ``atropos-serve-model "$MODEL"`` with
    ``$MODEL`` unset loads the model named ''."""
    blocks = _new_terminal_blocks(README)
    assert any("atropos-serve-model" in b.text for b in blocks), [b.where for b in blocks]
    for block in blocks:
        assert not _unset_variables(block.text), f"{block.where}: {_unset_variables(block.text)}"
        assert "source .venv/bin/activate" in block.text, f"{block.where}: activate the venv"


def test_the_unset_variable_check_catches_the_old_line():
    assert _unset_variables('atropos-serve-model "$MODEL" --port 9001\n') == {"MODEL"}
    assert not _unset_variables('MODEL=$(atropos-tiny-model)\natropos-serve-model "$MODEL"\n')


def test_readme_names_make_install_and_the_cpu_torch_index():
    text = README.read_text()
    assert "make install" in text
    assert "make .venv " not in text and "make .venv`" not in text  # there is no such target
    index = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert index in text and index in (ROOT / "docs" / "install.md").read_text()
    pin = Path(ROOT / "requirements-torch.txt").read_text()
    assert re.search(r"^torch==2\.13\.0", pin, re.M), "the documented pin moved: update the docs"
