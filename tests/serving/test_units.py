"""Pure pieces of the server: sampling filters, tool-call parsing, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atroposlib.cli.serve_model import build_parser
from atroposlib.serving.responses import parse_tool_calls
from atroposlib.serving.sampling import SamplingParams, filter_logits, sample


def _lp(values: list[float]) -> torch.Tensor:
    return torch.log_softmax(torch.tensor([values]), dim=-1)


def test_top_k_keeps_exactly_k_tokens():
    out = filter_logits(
        _lp([1.0, 4.0, 3.0, 2.0]), torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert torch.isfinite(out[0]).tolist() == [False, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_logits(probs.log(), torch.tensor([-1]), torch.tensor([0.8]), torch.tensor([0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([[0.6, 0.27, 0.08, 0.05]])
    out = filter_logits(probs.log(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.1]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-20, 20), min_size=2, max_size=30),
    k=st.integers(-1, 40),
    p=st.floats(0.01, 1.0),
    m=st.floats(0.0, 1.0),
)
@example(  # tied best tokens that the sort orders differently from argmax
    values=[18.5, 18.5, 17.4, -8.0, -15.9, -18.3, 10.5, 6.5, 3.7, 3.7, 13.7, -19.5, 2.7, 3.7, 18.5]
    + [-7.3, 4.1, 4.1, -18.3, -13.6],
    k=9,
    p=0.52,
    m=0.68,
)
def test_filters_always_keep_the_most_likely_token(values, k, p, m):
    lp = _lp(values)
    out = filter_logits(lp, torch.tensor([k]), torch.tensor([p]), torch.tensor([m]))
    # Tied best tokens are all "the most likely": one of them must survive.
    best = lp[0] == lp[0].max()
    assert torch.isfinite(out[0][best]).any()


def test_sample_reports_log_softmax_of_scaled_logits_and_is_seeded():
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.7, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
    ]

    def run():
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        return sample(logits, params, gens)

    a, b = run(), run()
    assert a.tokens == b.tokens
    assert a.tokens[1] == int(torch.argmax(logits[1]))
    for i, prm in enumerate(params):
        t = prm.temperature if prm.temperature > 0 else 1.0
        want = torch.log_softmax(logits[i] / t, dim=-1)[a.tokens[i]].item()
        assert abs(a.logprobs[i] - want) < 1e-6
    assert torch.topk(logits[2], 5).indices.tolist().count(a.tokens[2]) == 1
    assert len(a.top[0]) == 2 and a.top[1] == []


def test_sample_frequencies_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, [SamplingParams()] * 4000, [gen] * 4000)
    freq = torch.bincount(torch.tensor(out.tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_tool_calls_are_split_from_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "calculator", "arguments": {"e": "2+2"}}\n'
        "</tool_call>"
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"e": "2+2"}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )


def test_cli_flags_mirror_the_config_fields():
    ns = build_parser().parse_args(
        [
            "/m",
            "--port",
            "9100",
            "--device",
            "cpu",
            "--max-model-len",
            "512",
            "--served-model-name",
            "a",
            "b",
            "--api-key",
            "k",
            "--dtype",
            "float32",
        ]
    )
    assert (ns.model, ns.port, ns.max_model_len, ns.served_model_name, ns.api_key) == (
        "/m",
        9100,
        512,
        ["a", "b"],
        "k",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/m", "--device", "tpu"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["/m", "--port", "70000"], "--port"),
        (["/m", "--max-n", "0"], "--max-n"),
        (["/m", "--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction"),
        (["/m", "--client-template-timeout", "600"], "--client-template-timeout"),
    ],
)
def test_cli_value_out_of_bounds_exits_2_naming_the_flag(argv, needle, capsys):
    from atroposlib.cli.serve_model import main

    with pytest.raises(SystemExit) as info:
        main(argv)  # refused before any model is loaded
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("atropos-serve-model: error: invalid value: ") and needle in err


async def test_engine_joins_staggered_requests_without_changing_results(tmp_path):
    """Sequences that join a running batch (left-padded caches, llama config) keep exact
    logprobs, and n>1 rows that share a prefilled prompt diverge independently."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.serving.engine import Engine
    from atroposlib.tiny_model import build_tiny_model
    from tests.serving.support import direct_logprobs

    path = build_tiny_model(tmp_path / "llama", seed=3, arch="llama", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    engine = Engine(model, tok, max_model_len=256, max_num_seqs=8)
    await engine.start()
    try:
        prompts = [
            tok.encode("Hi"),
            tok.encode("What is 12 + 30? Think step by step."),
            tok.encode("Zoe has 7 marbles."),
        ]

        async def one(i: int):
            while engine.generated_tokens < 2 * i:  # join while the earlier ones run
                await asyncio.sleep(0.001)
            return await engine.generate(
                prompts[i], SamplingParams(n=2, max_tokens=6 + 4 * i, seed=i, ignore_eos=True)
            )

        results = await asyncio.gather(*(one(i) for i in range(3)))
    finally:
        await engine.stop()
    for i, res in enumerate(results):
        assert [len(o.token_ids) for o in res.outputs] == [6 + 4 * i] * 2
        assert res.outputs[0].token_ids != res.outputs[1].token_ids
        for out in res.outputs:
            want = direct_logprobs(model, prompts[i], out.token_ids)
            assert max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True)) < 1e-4
    assert engine.steps < sum(6 + 4 * i for i in range(3))  # steps were shared


def test_penalties_steer_the_choice_but_not_the_reported_logprob():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.0]])
    plain = sample(logits, [SamplingParams(temperature=0)], [None], [([], [0])])
    assert plain.tokens == [0]
    for prm in (
        SamplingParams(temperature=0, frequency_penalty=0.6, presence_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=2.0),
    ):
        out = sample(
            logits, [prm], [None], [([3], [0, 0])] if prm.frequency_penalty else [([0], [])]
        )
        assert out.tokens == [1]
        want = torch.log_softmax(logits[0], dim=-1)[1].item()
        assert abs(out.logprobs[0] - want) < 1e-6


def test_repetition_penalty_multiplies_negative_logits():
    from atroposlib.serving.sampling import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [([0, 1], [])])
    assert out.tolist() == [[1.0, -2.0, 0.5]]
    counts = apply_penalties(
        logits, [SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)], [([2], [0, 0])]
    )
    assert counts.tolist() == [[-0.5, -1.0, 0.5]]
