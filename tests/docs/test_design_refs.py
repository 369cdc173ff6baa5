"""Code cites its design decisions as ``(docs/design.md, "<section>")``, and those sections exist.

``scripts/rewrite_design_refs.py`` turns the old numbered references (to a document that is
not in the repository) into such citations; its ``--check`` logic is what these tests run.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

REQUIRED_SECTIONS = (
    "Delivery guarantee",
    "Security model",
    "Bounded inputs",
    "Per-token fields",
    "Precision policy",
    "Policy versions and staleness",
    "Differences from the original",
)
"""Titles other engineers already cite; renaming one breaks their citations."""


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "rewrite_design_refs", ROOT / "scripts" / "rewrite_design_refs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


refs = _load_script()

# The old forms are built from parts, so that this file reads like the code it checks.
OLD = "D"
SECT = "\N{SECTION SIGN}"
DOC = "S" + "PEC"


def _sections_of_doc() -> list[str]:
    return refs.design_sections(ROOT)


def test_design_document_has_the_sections_code_cites():
    titles = _sections_of_doc()
    assert len(titles) == len(set(titles)), "two sections share a title"
    missing = [t for t in REQUIRED_SECTIONS if t not in titles]
    assert not missing, f"docs/design.md lacks {missing}"
    table = set(refs.SECTIONS_BY_DECISION.values()) | set(refs.SECTIONS_BY_CHAPTER.values())
    unknown = sorted(table - set(titles))
    assert not unknown, f"the rewrite table points at sections that do not exist: {unknown}"


def test_every_cited_section_exists():
    bad = refs.find_bad_citations(ROOT)
    assert not bad, "citations naming no section of docs/design.md:\n" + "\n".join(map(str, bad))


def test_every_path_the_design_document_names_exists():
    text = (ROOT / refs.DESIGN).read_text(encoding="utf-8")
    pattern = (
        r"`((?:atroposlib|example_trainer|tests|benchmarks|scripts|environments|docs)/[\w./-]+)`"
    )
    missing = sorted({p for p in re.findall(pattern, text) if not (ROOT / p).exists()})
    assert not missing, f"docs/design.md names paths that do not exist (moved?): {missing}"


def test_no_old_design_reference_remains():
    left = refs.find_references(ROOT)
    assert not left, (
        "run `python scripts/rewrite_design_refs.py`, or cite docs/design.md by hand:\n"
        + "\n".join(map(str, left))
    )


@pytest.mark.parametrize(
    "line",
    [
        f'    """Delivery (see {DOC} {OLD}19): a served batch stays."""',
        f"# read by handlers.ingest_groups ({OLD}17)",
        f"counts and lengths ({OLD}5/{OLD}17); more",
        f"Pure scheduling arithmetic ({SECT}2.7, {SECT}2.8, {SECT}4.5, {SECT}4.6).",
        f"Selection follows the original tools ({DOC} {SECT}7.2-7.3). Two formats",
        f"command line of an environment ({OLD}14, {SECT}4.4).",
        f"Metric assembly for W&B ({SECT}4.10).",
        f"Security ({DOC} {OLD}9, {OLD}18): with an API key",
        *(old for old, _new in refs.EXACT),
    ],
)
def test_rewrite_turns_each_known_form_into_a_citation_of_an_existing_section(line):
    new = refs.rewrite_line(line)
    assert not refs.REFERENCE_RE.search(new), new
    cited = [title for _line, title in refs.citations(new)]
    titles = _sections_of_doc()
    assert all(t in titles for t in cited), cited
    assert cited or "must still agree" in new or "sequence by sequence; the" in new, new


def test_rewrite_picks_the_section_by_number():
    assert refs.rewrite_line(f"({OLD}20)") == '(docs/design.md, "Precision policy")'
    assert refs.rewrite_line(f"({SECT}4.11)") == '(docs/design.md, "Offline modes")'
    assert refs.rewrite_line(f"({SECT}4.1)") == '(docs/design.md, "Environment lifecycle")'
    assert refs.rewrite_line(f"({OLD}7, {OLD}9)") == (
        '(docs/design.md, "Delivery guarantee"; docs/design.md, "Security model")'
    )


def test_rewrite_is_idempotent_and_leaves_other_text_alone():
    text = (
        f"x = 1  # ({OLD}19)\n"
        "SPECIAL_TOKENS = ()  # not a reference\n"
        f"keep ({OLD}2)  # design-refs: ok\n"
        f"unknown ({OLD}99)\n"
    )
    once = refs.rewrite_text(text)
    assert refs.rewrite_text(once) == once
    lines = once.splitlines()
    assert lines[0] == 'x = 1  # (docs/design.md, "Delivery guarantee")'
    assert lines[1:] == text.splitlines()[1:]


def test_check_finds_what_the_rewrite_leaves_and_the_rewrite_keeps_python_valid(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / refs.DESIGN, tmp_path / refs.DESIGN)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "doc.py").write_text(f'"""Delivery ({DOC} {OLD}19)."""\n', encoding="utf-8")
    # Inside a one-line string the citation's quotes would end the string: left alone.
    (pkg / "string.py").write_text(f'MESSAGE = "see ({OLD}19)"\n', encoding="utf-8")
    (pkg / "bad.md").write_text(
        'Cite as (docs/design.md, "<section title>").\nCited: (docs/design.md, "No such section").\n',
        encoding="utf-8",
    )

    (pkg / "wrapped.py").write_text(
        '# see (docs/design.md, "Policy\n# versions and staleness")\n'
        'X = 1  # (docs/design.md, "Delivery\n# nonsense")\n',
        encoding="utf-8",
    )

    files = refs.repo_files(tmp_path)
    assert files == [
        "docs/design.md",
        "pkg/bad.md",
        "pkg/doc.py",
        "pkg/string.py",
        "pkg/wrapped.py",
    ]
    assert [f.path for f in refs.find_references(tmp_path, files)] == [
        "pkg/doc.py",
        "pkg/string.py",
    ]
    bad = refs.find_bad_citations(tmp_path, files)
    # bad.md's line 1 is a placeholder; a title may wrap onto the next comment line
    assert [(f.path, f.line) for f in bad] == [("pkg/bad.md", 2), ("pkg/wrapped.py", 3)]

    assert refs.rewrite_files(tmp_path, files) == 1
    assert (
        pkg / "doc.py"
    ).read_text() == '"""Delivery (docs/design.md, "Delivery guarantee")."""\n'
    assert (pkg / "string.py").read_text() == f'MESSAGE = "see ({OLD}19)"\n'
    assert [f.path for f in refs.find_references(tmp_path, files)] == ["pkg/string.py"]
