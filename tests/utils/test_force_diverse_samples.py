"""Diverse first tokens: distinct, drawn from the top-k, and continued by the model."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.utils.force_diverse_samples import (
    generate_with_diverse_first_tokens,
    select_diverse_first_tokens,
)


@settings(deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=3), st.floats(-20, 0), max_size=20),
    st.integers(0, 25),
    st.floats(0, 2),
)
def test_selected_first_tokens_are_distinct_and_from_the_pool(pool, n, temperature):
    chosen = select_diverse_first_tokens(pool, n, temperature, random.Random(0))
    assert len(chosen) == min(n, len(pool))
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(pool)


def test_zero_temperature_takes_the_most_likely_tokens_in_order():
    pool = {"a": -3.0, "b": -0.1, "c": -1.0}
    assert select_diverse_first_tokens(pool, 2, 0.0) == ["b", "c"]


class _FakeCompletionServer:
    def __init__(self, top):
        self.top = top
        self.calls = []

    async def completion(self, prompt, n=1, max_tokens=16, logprobs=None, temperature=1.0, **kw):
        self.calls.append((prompt, n, max_tokens, logprobs))
        if logprobs:
            lp = SimpleNamespace(top_logprobs=[self.top])
            return SimpleNamespace(choices=[SimpleNamespace(text="?", logprobs=lp)])
        return SimpleNamespace(
            choices=[SimpleNamespace(text=f"<{prompt}>", logprobs=None) for _ in range(n)]
        )


async def test_generation_continues_from_each_distinct_first_token():
    server = _FakeCompletionServer({"A": -0.1, "B": -0.2, "C": -0.3})
    texts = await generate_with_diverse_first_tokens(server, "Q:", n=3, max_tokens=8, seed=1)
    assert sorted(t[0] for t in texts) == ["A", "B", "C"]
    for text in texts:
        assert text == text[0] + f"<Q:{text[0]}>"
    assert server.calls[0][3] == 20 and server.calls[0][2] == 1


async def test_generation_fills_up_with_free_samples_when_top_k_is_small():
    server = _FakeCompletionServer({"A": -0.1})
    texts = await generate_with_diverse_first_tokens(server, "Q:", n=3, max_tokens=8)
    assert len(texts) == 3 and texts[0].startswith("A")
    assert texts[1:] == ["<Q:>", "<Q:>"]
