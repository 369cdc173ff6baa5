"""Fail when torch appears in the core dependencies: environment nodes must not need it."""

from __future__ import annotations

import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path


def main() -> int:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    offenders = [
        d
        for d in project.get("dependencies", [])
        if d.split("[")[0].strip().lower().startswith("torch")
    ]
    if offenders:
        print(f"torch must not be a core dependency: {offenders}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
