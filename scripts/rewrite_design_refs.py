"""Point references to the old numbered design notes at ``docs/design.md``.

Comments and docstrings used to cite decisions by number (a letter D and a number, or a
section sign and a section number) in a document that is not in the repository. The
decisions now live in ``docs/design.md``, and a citation names the section there:
``(docs/design.md, "Delivery guarantee")``.

Usage::

    python scripts/rewrite_design_refs.py                  # rewrite every .py/.md file in the repository
    python scripts/rewrite_design_refs.py docs README.md   # only files under these paths
    python scripts/rewrite_design_refs.py --ext .md docs environments
    python scripts/rewrite_design_refs.py --dry-run        # print what would change
    python scripts/rewrite_design_refs.py --check          # exit 1 if a reference remains or a
                                                           # citation names no section

The rewrite is line by line and idempotent: the exact forms found in the code are rewritten
first (so the sentence still reads well), then any parenthesised list of numbers, through
the number -> section table. A Python file that parsed before and would not parse after is
left alone and reported. A line that mentions such a number for another reason can say so
with the marker ``design-refs: ok``.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

ROOT = Path(__file__).resolve().parent.parent
DESIGN = "docs/design.md"

SUFFIXES = (".py", ".md", ".toml", ".yaml", ".yml")
"""The kinds of file scanned: code, docs and configs that can carry comments."""

EXCLUDED = frozenset({"scripts/rewrite_design_refs.py", "tests/docs/test_design_refs.py"})
"""Files that spell out the old forms on purpose (this table and its tests)."""

IGNORE_MARKER = "design-refs: ok"

REFERENCE_RE = re.compile(r"\bD[0-9]{1,2}\b|§ ?[0-9]|\bSPEC\b")
"""What counts as a reference to the old document: a decision number, a section sign
followed by a number, or the document's name."""

CITATION_RE = re.compile(r'docs/design\.md,\s+(?:#\s*)?\\?"([^"\\<][^"\\]{0,100})\\?"')
"""A citation of a section of docs/design.md. The quotes may be escaped (inside a string) and
the title may wrap onto the next line (of a comment, too); a title in angle brackets, as in
``"<section title>"``, is a placeholder in prose, not a citation."""

_WRAP = re.compile(r"\s*\n\s*(?:#\s*)?")
"""A line break inside a wrapped title, with the next comment line's ``#``."""


def citations(text: str) -> List[tuple[int, str]]:
    """``(line number, section title)`` of every citation of docs/design.md in ``text``."""
    return [
        (text.count("\n", 0, m.start()) + 1, _WRAP.sub(" ", m.group(1)).strip())
        for m in CITATION_RE.finditer(text)
    ]


SECTIONS_BY_DECISION = {
    1: "Differences from the original",
    2: "Rollout API routes",
    3: "Rollout API routes",
    4: "Rollout API routes",
    5: "Per-token fields",
    6: "Rollout API routes",
    7: "Delivery guarantee",
    8: "Delivery guarantee",
    9: "Security model",
    10: "Delivery guarantee",
    11: "Inference servers",
    12: "Rollout API routes",
    13: "Inference servers",
    14: "Environment command line",
    15: "Differences from the original",
    16: "Differences from the original",
    17: "Per-token fields",
    18: "Security model",
    19: "Delivery guarantee",
    20: "Precision policy",
    21: "Dependencies",
    22: "Differences from the original",
    23: "Differences from the original",
}
"""Decision number -> the section of docs/design.md that states it."""

SECTIONS_BY_CHAPTER = {
    "1": "Differences from the original",
    "2": "Rollout API routes",
    "2.7": "Throttling and scheduling",
    "2.8": "Throttling and scheduling",
    "3": "Data shapes",
    "4": "Environment lifecycle",
    "4.4": "Environment command line",
    "4.5": "Throttling and scheduling",
    "4.6": "Throttling and scheduling",
    "4.10": "Files and metrics",
    "4.11": "Offline modes",
    "4.12": "Teacher distillation",
    "5": "Inference servers",
    "6": "Trainer data conventions",
    "7": "Export tools",
    "8": "Bundled environments",
}
"""Section number of the old document -> section of docs/design.md (longest prefix wins)."""


def cite(*sections: str) -> str:
    """The citation of one or more sections, in the form code comments use."""
    return "; ".join(f'docs/design.md, "{s}"' for s in dict.fromkeys(sections))


EXACT: List[tuple[str, str]] = [
    # atroposlib/api/models.py, the comment above PER_TOKEN_OPTIONAL (two lines)
    ("sequence by sequence (D5); the", "sequence by sequence; the"),
    (
        "(D17: the original accepts any length).",
        f"(the original accepts any length; {cite('Per-token fields')}).",
    ),
    # atroposlib/api/models.py, module docstring
    ("must agree, D5/D17).", f"must agree; {cite('Per-token fields')})."),
    # atroposlib/api/decode.py
    ("(for the D5/D17 checks)", f"(for the length checks; {cite('Per-token fields')})"),
    # atroposlib/api/README.md
    ("the D5/D17 checks need", f"the length checks ({cite('Per-token fields')}) need"),
    # atroposlib/envs/api_client.py
    ("(query parameter, D2)", f"(query parameter; {cite('Rollout API routes')})"),
    ("(D9, §4.8)", f"({cite('Environment lifecycle')})"),
    # atroposlib/envs/workers.py: the re-queue rule is part of losing nothing
    ("(§4.6, D10)", f"({cite('Delivery guarantee')})"),
    # example_trainer/api.py
    (
        "(the API's at-least-once delivery, SPEC D19)",
        f"(the API's at-least-once delivery; {cite('Delivery guarantee')})",
    ),
    # example_trainer/data.py
    ("(SPEC §3.2, §6.1-6.2)", f"({cite('Trainer data conventions')})"),
    # tests/test_public_names.py
    (
        '"""D1: every public name the original exposes is importable from the same module path."""',
        '"""Every public name the original exposes is importable from the same module path '
        f'({cite("Differences from the original")})."""',
    ),
    # tests/api/test_ingest.py
    (
        "# ------------------------------------------------------------------ D17 against run-api",
        f"# ---------------- lenient per-token fields against run-api ({cite('Per-token fields')})",
    ),
    ("# D5 still holds for these", "# counts and mask lengths must still agree for these"),
]
"""The forms found in the repository, rewritten so that the sentence still reads well."""

_TOKEN = r"(?:D[0-9]{1,2}|§ ?[0-9]+(?:\.[0-9]+)*(?:-[0-9]+(?:\.[0-9]+)*)?)"
_TOKENS = rf"{_TOKEN}(?:\s*[,/]\s*{_TOKEN})*"
GENERIC_PARENS = re.compile(rf"\((?:SPEC\s+)?({_TOKENS})\)")
"""``(D17)``, ``(SPEC D18)``, ``(§2.7, §2.8)``, ``(D5/D17)``, ``(SPEC §7.2-7.3)`` ..."""
GENERIC_BARE = re.compile(rf"\bSPEC\s+({_TOKENS})")
"""``SPEC D19`` without parentheses."""


def section_of(token: str) -> str:
    """The docs/design.md section for one old reference (``D17``, ``§4.10``, ``§7.2-7.3``).

    Raises KeyError for a number the table does not know.
    """
    token = token.strip()
    if token.startswith("D"):
        return SECTIONS_BY_DECISION[int(token[1:])]
    number = token.lstrip("§ ").split("-")[0]
    parts = number.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in SECTIONS_BY_CHAPTER:
            return SECTIONS_BY_CHAPTER[key]
    raise KeyError(token)


def _sections(tokens: str) -> List[str]:
    return [section_of(t) for t in re.findall(_TOKEN, tokens)]


def rewrite_line(line: str) -> str:
    """One line with every known reference replaced by a citation of docs/design.md."""
    if IGNORE_MARKER in line or not REFERENCE_RE.search(line):
        return line
    for old, new in EXACT:
        line = line.replace(old, new)

    def parens(m: re.Match[str]) -> str:
        try:
            return f"({cite(*_sections(m.group(1)))})"
        except KeyError:
            return m.group(0)

    def bare(m: re.Match[str]) -> str:
        try:
            return cite(*_sections(m.group(1)))
        except KeyError:
            return m.group(0)

    line = GENERIC_PARENS.sub(parens, line)
    return GENERIC_BARE.sub(bare, line)


def rewrite_text(text: str) -> str:
    """``text`` with :func:`rewrite_line` applied to each line (line endings kept)."""
    return "".join(rewrite_line(line) for line in text.splitlines(keepends=True))


def repo_files(root: Path = ROOT, suffixes: Sequence[str] = SUFFIXES) -> List[str]:
    """Paths (relative, with ``/``) of the repository's files of the given kinds.

    Tracked files and untracked files git does not ignore; without git, a walk that skips
    hidden directories, virtual environments and run outputs.
    """
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = [
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if not any(
                part.startswith(".") or part in {"__pycache__", "runs", "build", "dist"}
                for part in p.relative_to(root).parts[:-1]
            )
        ]
    return sorted(
        n
        for n in set(names)
        if n.endswith(tuple(suffixes)) and n not in EXCLUDED and (root / n).is_file()
    )


def select(files: Iterable[str], paths: Sequence[str], root: Path = ROOT) -> List[str]:
    """The files under any of ``paths`` (files or directories); all of them when none given."""
    if not paths:
        return list(files)
    wanted = [(root / p).resolve().relative_to(root.resolve()).as_posix() for p in paths]
    return [
        f for f in files if any(w in (".", "") or f == w or f.startswith(w + "/") for w in wanted)
    ]


@dataclass
class Finding:
    """A line that still cites the old document, or a citation naming no section."""

    path: str
    line: int
    text: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.problem}: {self.text.strip()}"


def design_sections(root: Path = ROOT) -> List[str]:
    """The titles of the ``##`` sections of docs/design.md."""
    text = (root / DESIGN).read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^## (.+)$", text, re.MULTILINE)]


def _lines(root: Path, files: Iterable[str]) -> Iterator[tuple[str, int, str]]:
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            yield rel, number, line


def find_references(root: Path = ROOT, files: Iterable[str] | None = None) -> List[Finding]:
    """Every line that still refers to the old document by number or by name."""
    files = repo_files(root) if files is None else files
    return [
        Finding(rel, n, line, "old design reference")
        for rel, n, line in _lines(root, files)
        if IGNORE_MARKER not in line and REFERENCE_RE.search(line)
    ]


def find_bad_citations(root: Path = ROOT, files: Iterable[str] | None = None) -> List[Finding]:
    """Every citation ``(docs/design.md, "<title>")`` whose title is not a section there."""
    files = repo_files(root) if files is None else files
    titles = set(design_sections(root))
    found = []
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.splitlines()
        found += [
            Finding(rel, n, lines[n - 1], f"no section {title!r} in {DESIGN}")
            for n, title in citations(text)
            if title not in titles
        ]
    return found


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def rewrite_files(root: Path, files: Iterable[str], dry_run: bool = False) -> int:
    """Rewrite ``files`` in place, printing each changed line; returns how many lines changed."""
    changed = 0
    for rel in files:
        path = root / rel
        try:
            old = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        new = rewrite_text(old)
        if new == old:
            continue
        if rel.endswith(".py") and _parses(old) and not _parses(new):
            print(f"{rel}: left alone, the rewrite would not parse", file=sys.stderr)
            continue
        for n, (a, b) in enumerate(zip(old.splitlines(), new.splitlines(), strict=True), 1):
            if a != b:
                changed += 1
                print(f"{rel}:{n}:\n  - {a.strip()}\n  + {b.strip()}")
        if not dry_run:
            path.write_text(new, encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: rewrite, or with ``--check`` report what is left (exit 1 if anything)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or directories (default: the repository)")
    parser.add_argument(
        "--ext",
        action="append",
        help=f"only files with this suffix (repeatable; default {' '.join(SUFFIXES)})",
    )
    parser.add_argument("--dry-run", action="store_true", help="print changes, write nothing")
    parser.add_argument(
        "--check",
        action="store_true",
        help="rewrite nothing; exit 1 if a reference remains or a citation names no section",
    )
    args = parser.parse_args(argv)
    files = select(repo_files(ROOT, tuple(args.ext or SUFFIXES)), args.paths)
    if args.check:
        findings = find_references(ROOT, files) + find_bad_citations(ROOT, files)
        for finding in findings:
            print(finding)
        print(f"{len(findings)} problem(s) in {len(files)} files")
        return 1 if findings else 0
    changed = rewrite_files(ROOT, files, dry_run=args.dry_run)
    verb = "would change" if args.dry_run else "changed"
    print(f"{verb} {changed} line(s) in {len(files)} files scanned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
