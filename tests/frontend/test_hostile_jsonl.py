"""Rollout files with lines no parser should choke on: nested 100,000 deep, or holding an
integer of more than 4,300 digits.

Before, ``jsonl2html``, ``view-run --file``, ``atropos-sft-gen --from-file`` and
``atropos-dpo-gen --from-file`` exited with a traceback (``RecursionError``, or
``ValueError`` from Python's int-string limit), and ``jsonl2html`` left a partial HTML
file. Now the renderer skips such lines with a warning naming the line; the other tools
exit 2 with one line naming it; none leaves a partial output.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest

from atroposlib.cli import dpo, sft, view_run
from atroposlib.frontend import jsonl2html
from atroposlib.testing.processes import PYTHON

DEEP = '{"scores": [1.0], "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
HUGE_INT = '{"scores": [1' + "0" * 5000 + '], "messages": [[{"role": "user", "content": "x"}]]}'
HOSTILE = {"deep": DEEP, "huge integer": HUGE_INT}


def _file(tmp_path: Path, make_group, bad: str) -> Path:
    good = json.dumps(make_group("Q: 1? A: ", ["a", "b"], [1.0, 0.0]))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join([good, bad, good]) + "\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, *args], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent
    )


@pytest.mark.parametrize("kind", HOSTILE)
def test_jsonl2html_skips_the_line_with_a_warning_naming_it(
    tmp_path, make_group, kind, caplog, capsys
):
    src = _file(tmp_path, make_group, HOSTILE[kind])
    out = tmp_path / "report.html"
    with caplog.at_level(logging.WARNING):
        code = jsonl2html.main([str(src), str(out)])
    err = caplog.text + capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "Traceback" not in err
    assert "rollouts.jsonl:2:" in err and "skipped" in err
    assert out.read_text().count('class="group') >= 2


TOOLS = {"view-run": view_run.main, "sft-gen": sft.main, "dpo-gen": dpo.main}
ARGS = {
    "view-run": ["--file", "{src}", "--port", "1"],
    "sft-gen": ["{out}", "--from-file", "{src}", "--save-messages", "--no-progress"],
    "dpo-gen": ["{out}", "--from-file", "{src}", "--save-messages", "--no-progress"],
}


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("tool", TOOLS)
def test_tools_exit_2_with_one_line_naming_the_line(
    tmp_path, make_group, kind, tool, caplog, capsys
):
    src = _file(tmp_path, make_group, HOSTILE[kind])
    out = tmp_path / "out.jsonl"
    args = [a.format(src=src, out=out) for a in ARGS[tool]]
    with caplog.at_level(logging.WARNING):
        code = TOOLS[tool](args)
    err = caplog.text + capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "rollouts.jsonl:2:" in lines[0], lines
    assert not out.exists()


def test_view_run_process_exits_2_with_one_line_naming_the_line(tmp_path, make_group):
    """``view-run``'s process smoke: the console module, in a process of its own."""
    src = _file(tmp_path, make_group, DEEP)
    run = _run("-m", "atroposlib.cli.view_run", "--file", str(src), "--port", "1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rollouts.jsonl:2:" in lines[0], lines


def test_jsonl2html_leaves_no_partial_report_when_rendering_fails(
    tmp_path, make_group, monkeypatch
):
    src = _file(tmp_path, make_group, json.dumps(make_group("Q? ", ["c"], [0.5])))
    out = tmp_path / "report.html"
    calls = []

    def failing(group, index):
        calls.append(index)
        if len(calls) == 2:
            raise OSError("disk full")
        return "<div class='group'></div>"

    monkeypatch.setattr(jsonl2html, "create_html_for_group", failing)
    with pytest.raises(OSError):
        jsonl2html.render_jsonl(src, out)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
