"""jsonl2html: the static report that ``process`` writes next to its jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from atroposlib.frontend.jsonl2html import create_html_for_group, generate_html, main


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_generate_html_defaults_to_stem_html_next_to_input(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "run.jsonl", [{"messages": ["hello world"], "scores": [1.0]}])
    out = generate_html(str(src))
    assert out == str(tmp_path / "run.html")
    page = Path(out).read_text()
    assert "<title>Rollouts: run.jsonl</title>" in page
    assert "hello world" in page and "Reward: 1.0" in page


def test_string_and_nested_message_formats_render_with_roles_and_score_classes() -> None:
    group = {
        "messages": [
            [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "**4**"},
            ],
            "plain string rollout",
            [{"role": "assistant", "content": "zero"}],
        ],
        "scores": [1.0, -1.0, 0.0],
    }
    block = create_html_for_group(group, 7)
    assert block.startswith("<details><summary>Group 7</summary>")
    assert "<strong>User</strong>: What is 2+2?" in block
    assert "<strong>Assistant</strong>: <strong>4</strong>" in block
    assert "plain string rollout" in block
    assert block.count('class="item reward-positive"') == 1
    assert block.count('class="item reward-negative"') == 1
    assert block.count('class="item reward-zero"') == 1


def test_mismatched_lengths_are_trimmed_to_the_shorter_list() -> None:
    block = create_html_for_group({"messages": ["a1", "b2", "c3"], "scores": [0.5, -0.5]}, 0)
    assert block.count('<div class="item') == 2
    assert "c3" not in block
    block = create_html_for_group({"messages": ["only"], "scores": [1.0, 2.0, 3.0]}, 0)
    assert block.count('<div class="item') == 1 and "Reward: 2.0" not in block


def test_markdown_fenced_code_and_tables_render() -> None:
    text = "```python\nprint('x')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    block = create_html_for_group({"messages": [text], "scores": [1]}, 0)
    assert '<code class="language-python">' in block
    assert "<table>" in block and "<td>1</td>" in block


def test_raw_html_and_javascript_links_in_rollouts_are_neutralised() -> None:
    evil = "<script>alert(1)</script> [click](javascript:alert(2)) <img src=x onerror=alert(3)>"
    block = create_html_for_group({"messages": [evil], "scores": [1]}, 0)
    assert "<script>" not in block and "&lt;script&gt;" in block
    assert "javascript:" not in block
    assert "<img" not in block


def test_lines_without_messages_or_scores_and_malformed_json_are_skipped(
    tmp_path: Path, caplog
) -> None:
    src = _write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"messages": ["good one"], "scores": [1.0]},
            "{not json",
            {"tokens": [[1, 2]], "scores": [1.0]},
            {"messages": ["second good"], "scores": [-1.0]},
        ],
    )
    with caplog.at_level("WARNING"):
        page = Path(generate_html(str(src), str(tmp_path / "o" / "out.html"))).read_text()
    assert "Group 0" in page and "Group 1" in page and "Group 2" not in page
    assert "mixed.jsonl:2" in caplog.text and "mixed.jsonl:3" in caplog.text


def test_empty_input_gives_a_page_saying_so(tmp_path: Path) -> None:
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    page = Path(generate_html(str(src))).read_text()
    assert "No groups with messages and scores" in page


def test_cli_exit_codes_and_messages(tmp_path: Path, capsys) -> None:
    good = _write_jsonl(tmp_path / "g.jsonl", [{"messages": ["x"], "scores": [1]}, "oops"])
    assert main([str(good)]) == 0
    assert "wrote 1 groups" in capsys.readouterr().out
    assert main([str(good), "--strict"]) == 3
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert main([str(empty)]) == 1
    assert "the file is empty" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_runs_as_a_script_with_fire_style_flags(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "s.jsonl", [{"messages": ["via module"], "scores": [0.25]}])
    out = tmp_path / "custom.html"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atroposlib.frontend.jsonl2html",
            "--input_path",
            str(src),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "via module" in out.read_text()
