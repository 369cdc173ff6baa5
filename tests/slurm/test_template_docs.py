"""docs/multi-node.md shows the Slurm template's own lines, and the template is shellcheck-clean.

Every shell fragment of the page marked as a fragment of ``examples/slurm/atropos.sbatch`` must be
the template's text: runs of lines separated by ``# ...`` (lines left out), each run found in the
template as it stands, in order. A change to the template that the page does not follow fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from tests.docs.runner import parse_blocks

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "slurm" / "atropos.sbatch"
PAGE = ROOT / "docs" / "multi-node.md"
ELISION = "# ..."


def _fragments() -> list:
    return [
        b
        for b in parse_blocks(PAGE)
        if b.kind == "skip" and "fragment of examples/slurm/atropos.sbatch" in b.arg
    ]


def _runs(text: str) -> List[List[str]]:
    """The fragment's runs of lines between ``# ...`` elisions."""
    runs: List[List[str]] = [[]]
    for line in text.rstrip("\n").splitlines():
        if line.strip() == ELISION:
            runs.append([])
        else:
            runs[-1].append(line.rstrip())
    return [r for r in runs if r]


def _find(lines: List[str], run: List[str], start: int) -> int:
    """Index in ``lines`` (from ``start``) where ``run`` begins, or -1."""
    for i in range(start, len(lines) - len(run) + 1):
        if lines[i : i + len(run)] == run:
            return i
    return -1


def test_the_page_shows_every_part_of_the_template():
    fragments = _fragments()
    # wait_healthy/step, preamble, nodes and key, inference, run-api, trainer, environments
    assert len(fragments) >= 7, [b.where for b in fragments]
    text = "\n".join(b.text for b in fragments)
    for must in (
        "--env.tokenizer_name",
        "--training-steps",
        "ATROPOS_SERVE_MODEL_API_KEY",
        "--api-key-file",
        "job.log",
    ):
        assert must in text, must


@pytest.mark.parametrize("block", _fragments(), ids=lambda b: b.where)
def test_each_fragment_is_the_templates_text(block):
    lines = [line.rstrip() for line in TEMPLATE.read_text().splitlines()]
    at = 0
    for run in _runs(block.text):
        found = _find(lines, run, at)
        assert found >= 0, (
            f"{block.where}: not in {TEMPLATE.name} (after line {at}):\n" + "\n".join(run)
        )
        at = found + len(run)


def test_a_fragment_that_differs_is_caught():
    lines = [line.rstrip() for line in TEMPLATE.read_text().splitlines()]
    changed = _runs(_fragments()[-1].text)[0]
    changed = [changed[0].replace("sglang", "sglang2"), *changed[1:]]
    assert _find(lines, changed, 0) == -1


def test_job_output_is_not_written_where_sbatch_was_called():
    text = TEMPLATE.read_text()
    assert "#SBATCH --output=/dev/null" in text
    assert 'exec > >(tee -a "$RUN/job.log") 2>&1' in text


def test_template_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck must run under CI (make shellcheck installs it)")
        pytest.skip("shellcheck not installed (make shellcheck)")
    r = subprocess.run(["shellcheck", str(TEMPLATE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
