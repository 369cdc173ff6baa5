"""frontend/generators.py: the one command line behind atropos-sft-gen and atropos-dpo-gen."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from atroposlib.cli import dpo, sft, view_run
from atroposlib.frontend import generators
from atroposlib.frontend.export import Selection, group_view, pair_dpo, select_sft
from atroposlib.frontend.generators import DPO, SFT, build_parser, options_argv


def _options(parser) -> set[str]:
    return set(vars(parser.parse_args(["out.jsonl"])))


def test_the_two_generators_differ_only_in_their_own_options() -> None:
    sft_flags, dpo_flags = _options(build_parser(SFT)), _options(build_parser(DPO))
    assert sft_flags - dpo_flags == {"save_top_n_per_group", "tasks_per_step"}
    assert dpo_flags - sft_flags == {"save_n_pairs_per_group"}
    sft_args = build_parser(SFT).parse_args(["out.jsonl"])
    dpo_args = build_parser(DPO).parse_args(["out.jsonl"])
    assert (sft_args.minimum_score_diff_max_min, dpo_args.minimum_score_diff_max_min) == (0.0, 0.5)
    assert (sft_args.save_top_n_per_group, sft_args.tasks_per_step) == (3, 64)
    assert dpo_args.save_n_pairs_per_group == 3


def test_cli_parsers_are_the_shared_parser() -> None:
    assert sft.build_parser().prog == "atropos-sft-gen"
    assert dpo.build_parser().prog == "atropos-dpo-gen"
    assert _options(sft.build_parser()) == _options(build_parser(SFT))
    assert _options(dpo.build_parser()) == _options(build_parser(DPO))


def test_view_run_and_the_generators_take_the_same_api_options() -> None:
    viewer = view_run.build_parser().parse_args([])
    gen = build_parser(SFT).parse_args(["out.jsonl"])
    for dest in ("api_url", "group_size", "max_token_len", "reset_api"):
        assert getattr(viewer, dest) == getattr(gen, dest), dest
    assert viewer.tokenizer is None  # file mode shows token ids without one
    assert gen.tokenizer == "NousResearch/DeepHermes-3-Llama-3-8B-Preview"


def test_options_argv_gives_switches_only_when_true_and_values_as_text() -> None:
    loaded = SimpleNamespace(name_or_path="/models/tiny")
    argv = options_argv(
        DPO,
        {
            "filepath": Path("out.jsonl"),
            "api_url": "http://api:8000",
            "tokenizer": loaded,
            "save_messages": True,
            "allow_negative_scores": False,
            "minimum_score_diff_max_min": 0.25,
            "save_n_pairs_per_group": 2,
        },
    )
    args = build_parser(DPO).parse_args(argv)
    assert args.filepath == "out.jsonl" and args.api_url == "http://api:8000"
    assert args.tokenizer == "/models/tiny" and args.no_progress
    assert args.save_messages and not args.allow_negative_scores
    assert "--allow-negative-scores" not in argv
    assert (args.minimum_score_diff_max_min, args.save_n_pairs_per_group) == (0.25, 2)


def test_selection_applies_the_rule_of_its_kind() -> None:
    view = group_view(
        {"scores": [1.0, -1.0, 0.5, 0.0]}, ["Q: a", "Q: b", "Q: c", "Q: d"]
    )  # prefix "Q: "
    sft_rows = Selection("sft", 2).records(view, False, random.Random(0))
    assert [r["completion"] for r in sft_rows] == [
        "abcd"[i] for i in select_sft(view.scores, 2, False, 0.0)
    ]
    dpo_rows = Selection("dpo", 2, min_diff=0.5, fmt="trl").records(view, False, random.Random(0))
    expected = pair_dpo(view.scores, 2, False, 0.5, random.Random(0))
    assert [(r["chosen"], r["rejected"]) for r in dpo_rows] == [
        ("abcd"[p], "abcd"[n]) for p, n in expected
    ]


@pytest.mark.parametrize(("spec", "batch", "steps"), [(SFT, 2 * 64, 5), (DPO, 2 * 8, 10)])
def test_run_registers_the_batch_each_tool_asks_for(monkeypatch, spec, batch, steps) -> None:
    seen: dict = {}

    def fake_run_generation(args, records_for, batch_size, num_steps):
        seen.update(batch_size=batch_size, num_steps=num_steps)
        return 0

    monkeypatch.setattr(generators, "run_generation", fake_run_generation)
    args = build_parser(spec).parse_args(["out.jsonl", "--num-seqs-to-save", "5"])
    assert generators.run(spec, args) == 0
    assert seen == {"batch_size": batch, "num_steps": steps}
