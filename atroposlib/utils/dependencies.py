"""Refuse to start on a dependency outside the range this package was tested with.

The supported ranges are the ones ``pyproject.toml`` declares, read back from the
installed package's metadata, so there is one place to change them. A command that
depends on a library's internals (the embedded engine on ``transformers``' cache
interface, the trainer on ``torch``) checks its libraries before it loads anything and
exits 2 with one line, instead of failing on every request later.

Example::

    from atroposlib.utils.dependencies import exit_if_unsupported

    exit_if_unsupported("atropos-serve-model", ["transformers", "tokenizers", "torch"])
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "atroposlib"


class UnsupportedDependency(RuntimeError):
    """A dependency is installed at a version outside the declared range."""


def installed_major(package: str) -> int:
    """The major version of an installed ``package`` (read from its metadata, not imported)."""
    return int(metadata.version(package).split(".")[0])


def declared_ranges(distribution: str = DISTRIBUTION) -> dict[str, Requirement]:
    """Each dependency of ``distribution`` (extras included) with its declared range.

    Where a name is declared more than once (core and an extra), the first one wins:
    ``pyproject.toml`` declares one range per package.
    """
    ranges: dict[str, Requirement] = {}
    for line in metadata.requires(distribution) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        ranges.setdefault(canonicalize_name(req.name), req)
    return ranges


def problems(packages: Iterable[str], ranges: dict[str, Requirement] | None = None) -> list[str]:
    """One line for each of ``packages`` that is installed outside its declared range.

    A package that is not installed, or has no declared range, is not this check's
    business (the import that needs it says so).
    """
    if ranges is None:
        try:
            ranges = declared_ranges()
        except metadata.PackageNotFoundError:  # running from a source tree, not installed
            return []
    found = []
    for name in packages:
        req = ranges.get(canonicalize_name(name))
        if req is None or not req.specifier:
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        try:
            ok = req.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            found.append(
                f"{req.name} {installed} is installed; {DISTRIBUTION} supports "
                f"{req.name}{req.specifier} (pip install '{req.name}{req.specifier}')"
            )
    return found


def check_supported(packages: Iterable[str]) -> None:
    """Raise :class:`UnsupportedDependency` naming the first package out of range."""
    found = problems(packages)
    if found:
        raise UnsupportedDependency(found[0])


def exit_if_unsupported(program: str, packages: Iterable[str]) -> None:
    """Exit 2 with one line on stderr when one of ``packages`` is out of range."""
    try:
        check_supported(packages)
    except UnsupportedDependency as exc:
        print(f"{program}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
