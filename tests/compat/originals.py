"""The original Atropos's environment files, fetched for the drop-in tests.

The files are not part of this repository: they come from the original package's source
distribution on PyPI (``atroposlib==0.4.0``), which ships its ``environments/`` folder.
``original_environments()`` looks for them under ``.cache/original-atroposlib-0.4.0/``
(ignored by git), and downloads the sdist with pip into a temporary folder when they are
absent, keeping only the ``environments/`` files. Without network the caller skips.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.4.0"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / f"original-atroposlib-{VERSION}"
ENVIRONMENTS = CACHE / "environments"
# Present once a download finished extracting (a half-written cache is not taken).
COMPLETE = CACHE / ".complete"


class OriginalUnavailable(RuntimeError):
    """The original's files are neither cached nor downloadable (the reason is the message)."""


def _extract_environments(sdist: Path, target: Path) -> None:
    prefix = f"atroposlib-{VERSION}/environments/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)]
        if not members:
            raise OriginalUnavailable(f"{sdist.name} has no environments/ folder")
        for member in members:
            rel = Path(member.name[len(prefix) :])
            if rel.is_absolute() or ".." in rel.parts:
                continue  # never write outside the cache
            dest = target / "environments" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            with src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)


def original_environments(timeout: float = 120.0) -> Path:
    """The folder holding the original's ``environments/`` files, downloading them once.

    Raises ``OriginalUnavailable`` naming why when pip cannot fetch the sdist.
    """
    if COMPLETE.is_file():
        return ENVIRONMENTS
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            f"atroposlib=={VERSION}",
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise OriginalUnavailable(
                f"pip download atroposlib=={VERSION} took over {timeout:.0f}s"
            ) from None
        sdists = sorted(Path(tmp).glob(f"atroposlib-{VERSION}.tar.gz"))
        if proc.returncode != 0 or not sdists:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise OriginalUnavailable(
                f"pip download atroposlib=={VERSION} failed (exit {proc.returncode}): {tail[0]}"
            )
        staging = Path(tempfile.mkdtemp(dir=tmp))
        _extract_environments(sdists[0], staging)
        if CACHE.exists():
            shutil.rmtree(CACHE)
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(CACHE))
        COMPLETE.write_text(f"atroposlib=={VERSION} sdist, environments/ only\n")
    return ENVIRONMENTS
