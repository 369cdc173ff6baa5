"""atropos-sft-gen / atropos-dpo-gen from a ``process`` jsonl: formats, dedupe, bad input."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from atroposlib.cli import dpo, sft


@pytest.fixture
def rollouts(tmp_path: Path, make_group, write_jsonl) -> Path:
    groups = [
        make_group("Q: 2+2? A: ", ["4", "5", "22", "4"], [1.0, -1.0, -1.0, 1.0]),
        make_group("Q: capital of France? A: ", ["Paris", "Lyon"], [1.0, -1.0]),
        make_group("Q: all wrong? A: ", ["x", "y"], [-1.0, -1.0]),
    ]
    return write_jsonl(tmp_path / "rollouts.jsonl", groups)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sft_from_file_decodes_prefix_and_completion(
    rollouts: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    out = tmp_path / "sft.jsonl"
    code = sft.main(
        [str(out), "--from-file", str(rollouts), "--tokenizer", str(tokenizer_dir), "--no-progress"]
    )
    assert code == 0
    rows = _lines(out)
    assert rows[0] == {"prefix": "Q: 2+2? A: ", "completion": "4", "score": 1.0}
    assert {r["completion"] for r in rows} == {"4", "Paris"}
    assert len(rows) == 3  # two "4" from group 0, one "Paris"; all-negative group gives nothing


def test_sft_dedupe_drops_repeated_lines(
    rollouts: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    out = tmp_path / "sft.jsonl"
    assert (
        sft.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--tokenizer",
                str(tokenizer_dir),
                "--dedupe",
                "--no-progress",
            ]
        )
        == 0
    )
    assert len(_lines(out)) == 2
    # appending the same data with --dedupe adds nothing new
    assert (
        sft.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--tokenizer",
                str(tokenizer_dir),
                "--dedupe",
                "--append-to-previous",
                "--no-progress",
            ]
        )
        == 1
    )
    assert len(_lines(out)) == 2


def test_sft_trl_messages_round_trip_through_load_dataset(rollouts: Path, tmp_path: Path) -> None:
    out = tmp_path / "sft_trl.jsonl"
    assert (
        sft.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--save-messages",
                "--format",
                "trl",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert ds.column_names == ["messages"]
    assert ds[0]["messages"][-1] == {"role": "assistant", "content": "4"}
    assert [m["role"] for m in ds[0]["messages"]] == ["system", "user", "assistant"]


def test_sft_trl_text_format_is_prompt_completion(
    rollouts: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    out = tmp_path / "sft_pc.jsonl"
    assert (
        sft.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--tokenizer",
                str(tokenizer_dir),
                "--format",
                "trl",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert sorted(ds.column_names) == ["completion", "prompt"]
    assert ds[0] == {"prompt": "Q: 2+2? A: ", "completion": "4"}


def test_dpo_trl_conversational_round_trip_through_load_dataset(
    rollouts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dpo_trl.jsonl"
    assert (
        dpo.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--save-messages",
                "--format",
                "trl",
                "--seed",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert sorted(ds.column_names) == ["chosen", "prompt", "rejected"]
    assert len(ds) == 3  # group 0: 2 pairs, group 1: 1 pair
    for row in ds:
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["chosen"][0]["role"] == "assistant" and row["rejected"][0]["role"] == "assistant"
    assert {r["chosen"][0]["content"] for r in ds} == {"4", "Paris"}
    assert {r["rejected"][0]["content"] for r in ds} <= {"5", "22", "Lyon"}


def test_dpo_atropos_format_keeps_the_original_keys(
    rollouts: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    out = tmp_path / "dpo.jsonl"
    assert (
        dpo.main(
            [
                str(out),
                "--from-file",
                str(rollouts),
                "--tokenizer",
                str(tokenizer_dir),
                "--num-seqs-to-save",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    rows = _lines(out)
    assert len(rows) == 1
    assert set(rows[0]) == {"prefix", "pos", "score", "neg"}
    assert rows[0]["prefix"] == "Q: 2+2? A: " and rows[0]["pos"] == "4" and rows[0]["score"] == 1.0


def test_existing_output_is_refused_without_append(rollouts: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "exists.jsonl"
    out.write_text("")
    assert (
        sft.main([str(out), "--from-file", str(rollouts), "--save-messages", "--no-progress"]) == 2
    )
    assert "--append-to-previous" in capsys.readouterr().err


def _run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120
    )


def test_bad_input_gives_a_message_and_exit_code_not_a_traceback(
    tmp_path: Path, write_jsonl, make_group, capsys, caplog
) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [make_group("q", ["a", "b"], [1.0, 0.0]), "{broken"])
    with caplog.at_level(logging.WARNING):
        code = sft.main(
            [str(tmp_path / "o_bad.jsonl"), "--from-file", str(bad), "--save-messages"]
            + ["--no-progress"]
        )
    err = caplog.text + capsys.readouterr().err
    assert code == 2, err
    assert "bad.jsonl:2: not valid JSON" in err and "Traceback" not in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for src, expected in ((empty, "the file is empty"), (tmp_path / "nope.jsonl", "no such file")):
        code = dpo.main(
            [
                str(tmp_path / f"o_{src.stem}.jsonl"),
                "--from-file",
                str(src),
                "--save-messages",
                "--no-progress",
            ]
        )
        assert code == 2
        assert expected in capsys.readouterr().err


def test_unreachable_api_gives_a_message_and_exit_code(tmp_path: Path, port: int) -> None:
    """``atropos-dpo-gen``'s process smoke (``atropos-sft-gen``'s is
    tests/cli/test_live_api.py::test_sft_gen_live_collects_from_batches)."""
    proc = _run_cli(
        "atroposlib.cli.dpo",
        str(tmp_path / "o.jsonl"),
        "--api-url",
        f"http://127.0.0.1:{port}",
        "--save-messages",
        "--no-progress",
    )
    assert proc.returncode == 1
    assert "cannot reach the rollout API" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_tokenizer_is_reported_clearly(rollouts: Path, tmp_path: Path, capsys) -> None:
    code = sft.main(
        [
            str(tmp_path / "o.jsonl"),
            "--from-file",
            str(rollouts),
            "--tokenizer",
            str(tmp_path / "no-such-tokenizer"),
            "--no-progress",
        ]
    )
    assert code == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
