"""``environments/TUTORIAL.md`` runs as written: its code blocks make ``repeat_env.py``,
its commands start a real ``atropos-serve-model`` (tiny model) and ``run-api`` and run the
environment in ``process``, ``serve`` and ``evaluate`` mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.docs.runner import DocRun, parse_blocks

TUTORIAL = ROOT / "environments" / "TUTORIAL.md"


def test_tutorial_is_linked_from_the_readmes():
    assert "environments/TUTORIAL.md" in (ROOT / "README.md").read_text()
    assert "TUTORIAL.md" in (ROOT / "environments" / "README.md").read_text()


def test_tutorial_runs_as_written(tmp_path):
    blocks = parse_blocks(TUTORIAL)
    code = [b for b in blocks if b.kind == "file"]
    assert [b.arg for b in code] == ["repeat_env.py"] * len(code) and len(code) >= 4
    with DocRun(tmp_path / "work", timeout=240) as run:
        run.run_page(TUTORIAL)
        serve_block = next(b for b in blocks if " serve " in b.text)
        serve_output = run.output(serve_block)
    source = (tmp_path / "work" / "repeat_env.py").read_text()
    code_lines = [line for line in source.splitlines() if line.strip()]
    assert 45 <= len(code_lines) <= 75, len(code_lines)  # "a 60-line environment"
    for step in ("get_next_item", "managed_server", "def score", "ScoredDataGroup", "evaluate"):
        assert step in source

    # process: two groups of four, each sequence with aligned tokens, masks and logprobs
    groups = [json.loads(line) for line in (tmp_path / "work" / "repeat.jsonl").open()]
    assert len(groups) == 2
    for group in groups:
        assert len(group["tokens"]) == len(group["scores"]) == 4
        for tokens, masks, logprobs in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            assert len(tokens) == len(masks) == len(logprobs)
            assert masks[0] == -100 and any(m != -100 for m in masks)
        assert all(0.0 <= s <= 1.0 for s in group["scores"])
        assert group["messages"][0][0]["content"].startswith("Repeat the word: ")
    assert (tmp_path / "work" / "repeat.html").exists()

    # serve: the batch the stand-in trainer pulled
    assert "2 groups; scores:" in serve_output, serve_output[-2000:]

    # evaluate: metrics.json and one sample per word
    metrics = json.loads((tmp_path / "work" / "evals" / "metrics.json").read_text())
    assert 0.0 <= metrics["results"]["all"]["eval/percent_correct"] <= 1.0
    samples = (tmp_path / "work" / "evals" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 9


def test_tutorial_code_is_lint_clean_and_the_page_passes_make_lint(tmp_path):
    """The assembled file passes ruff's checks; the page itself stays out of ruff's markdown
    formatter (``<!-- fmt:off -->``), which would dedent the method fragments."""
    blocks = [b for b in parse_blocks(TUTORIAL) if b.kind == "file"]
    assembled = tmp_path / "repeat_env.py"
    assembled.write_text("\n\n".join(b.text for b in blocks))
    ruff = [str(Path(sys.executable).parent / "ruff")]
    check = subprocess.run(
        [*ruff, "check", "--no-cache", "--select", "E9,F,I", str(assembled)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        [*ruff, "format", "--check", "--no-cache", str(TUTORIAL)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_second_terminal_commands_need_no_variable_from_the_first():
    """A block started in a new terminal (a background server) runs pasted as it is: it reads
    no shell variable that an earlier block set (``"$MODEL"`` there expands to nothing)."""
    import re

    for block in parse_blocks(TUTORIAL):
        if block.kind != "background":
            continue
        names = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", block.text))
        assert not names, f"{block.where}: uses ${sorted(names)} set in another terminal"
