"""pyproject.toml explains the core dependencies kept only for drop-in compatibility."""

from __future__ import annotations

import re

import tomllib

from tests.conftest import ROOT

COMPAT_ONLY = ("polars", "nltk", "aiofiles", "jsonlines")


def test_compat_only_dependencies_are_listed_with_a_reason():
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("dependencies = [")
    deps = text[start : text.index("\n]", start)]
    listed = {re.split(r"[<>=\[ ]", d)[0] for d in tomllib.loads(text)["project"]["dependencies"]}
    comments = " ".join(re.findall(r"^\s*#(.*)$", deps, flags=re.M))
    for name in COMPAT_ONLY:
        assert name in listed, f"{name} must stay a core dependency (the original lists it)"
        assert name in comments, f"no comment in pyproject.toml says why {name} is kept"
    assert "original" in comments and "drop-in" in comments, comments
