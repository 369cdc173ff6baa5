"""Exporters that write nothing say why (scores seen, the flag to pass) and leave no file."""

from __future__ import annotations

import json
from pathlib import Path

from atroposlib.cli import dpo, sft


def _all_negative(tmp_path: Path, make_group, write_jsonl) -> Path:
    groups = [
        make_group("Q: 1? A: ", ["a", "b"], [-1.0, -0.5]),
        make_group("Q: 2? A: ", ["c", "d"], [-1.0, -1.0]),
    ]
    return write_jsonl(tmp_path / "negative.jsonl", groups)


def test_sft_with_only_negative_scores_names_range_and_flag(
    tmp_path: Path, make_group, write_jsonl, capsys
) -> None:
    src = _all_negative(tmp_path, make_group, write_jsonl)
    out = tmp_path / "sft.jsonl"
    argv = [str(out), "--from-file", str(src), "--save-messages", "--no-progress"]
    assert sft.main(argv) == 1
    err = capsys.readouterr().err
    assert "no line matched the selection" in err
    assert "scores from -1 to -0.5" in err and "2 groups" in err
    assert "--allow-negative-scores" in err
    assert not out.exists(), "a run that wrote nothing must not leave an empty file"
    # The retry the message suggests works at once (no "already exists").
    assert sft.main([*argv, "--allow-negative-scores"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in rows] == [-0.5, -1.0, -1.0, -1.0]


def test_dpo_with_gaps_below_the_margin_names_the_gap_and_flag(
    tmp_path: Path, make_group, write_jsonl, capsys
) -> None:
    src = write_jsonl(
        tmp_path / "close.jsonl",
        [make_group("Q: 3? A: ", ["x", "y", "z"], [1.0, 0.8, 0.9])],
    )
    out = tmp_path / "dpo.jsonl"
    argv = [str(out), "--from-file", str(src), "--save-messages", "--no-progress"]
    assert dpo.main(argv) == 1
    err = capsys.readouterr().err
    assert "scores from 0.8 to 1" in err
    assert "was 0.2" in err and "--minimum-score-diff-max-min 0.5" in err
    assert not out.exists()
    assert dpo.main([*argv, "--minimum-score-diff-max-min", "0.1"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_failed_runs_leave_no_output_file(tmp_path: Path, make_group, write_jsonl) -> None:
    src = write_jsonl(tmp_path / "ok.jsonl", [make_group("Q? ", ["a", "b"], [1.0, 0.0])])
    out = tmp_path / "sub" / "sft.jsonl"
    code = sft.main(
        [
            str(out),
            "--from-file",
            str(src),
            "--tokenizer",
            str(tmp_path / "no-such-tokenizer"),
            "--no-progress",
        ]
    )
    assert code == 2
    assert not out.exists()
    unreachable = dpo.main(
        [str(out), "--api-url", "http://127.0.0.1:9", "--save-messages", "--no-progress"]
    )
    assert unreachable == 1
    assert not out.exists()
    assert sft.main([str(out), "--from-file", str(src), "--save-messages", "--no-progress"]) == 0
    assert out.exists()


def test_appending_run_that_matches_nothing_keeps_the_existing_file(
    tmp_path: Path, make_group, write_jsonl
) -> None:
    src = _all_negative(tmp_path, make_group, write_jsonl)
    out = tmp_path / "prev.jsonl"
    out.write_text('{"messages": [], "score": 1.0}\n')
    argv = [str(out), "--from-file", str(src), "--save-messages", "--no-progress"]
    assert sft.main([*argv, "--append-to-previous"]) == 1
    assert out.read_text() == '{"messages": [], "score": 1.0}\n'
