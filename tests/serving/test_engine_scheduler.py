"""The prefill admission plan (a pure function of the queue): budgets and FIFO."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.serving.sampling import SamplingParams
from atroposlib.serving.scheduler import Request, plan_prefill


def _req(length: int, n: int = 1) -> Request:
    return Request(list(range(1, length + 1)), SamplingParams(n=n), 8, None, None)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 4)), min_size=1, max_size=12),
    budget=st.integers(1, 256),
    free=st.integers(0, 16),
    partial_left=st.one_of(st.none(), st.integers(1, 400)),
)
def test_plan_respects_budgets_and_order(lengths, budget, free, partial_left):
    partial = None
    if partial_left is not None:
        partial = _req(partial_left + 5)
        partial.prefilled = 5
        free = max(free, partial.params.n)
    queue = collections.deque(_req(length, n) for length, n in lengths)
    original = list(queue)
    plan = plan_prefill(partial, queue, free=free, budget=budget, admit=True)
    admitted = [c.request for c in plan if c.request is not partial]
    assert admitted == original[: len(admitted)]  # FIFO: a prefix of the queue
    assert list(queue) == original[len(admitted) :]
    assert sum(r.params.n for r in admitted) + (partial.params.n if partial else 0) <= free
    assert len(plan) * max((c.count for c in plan), default=0) <= budget  # padded tokens
    incomplete = [i for i, c in enumerate(plan) if not c.completes]
    assert len(incomplete) <= 1 and (not incomplete or incomplete[0] == len(plan) - 1)
    if partial is not None:
        assert plan[0].request is partial and plan[0].start == 5
    if partial is None and original[0].params.n <= free:
        assert admitted  # the head always makes progress when its slots are free


def test_a_request_needing_more_slots_than_free_waits_and_blocks_the_queue():
    queue = collections.deque([_req(4, n=3), _req(4)])
    assert plan_prefill(None, queue, free=2, budget=100, admit=True) == []
    assert len(queue) == 2
    plan = plan_prefill(None, queue, free=3, budget=100, admit=True)
    assert [c.request.params.n for c in plan] == [3] and len(queue) == 1


def test_no_admission_while_a_swap_drains_but_the_partial_prompt_continues():
    partial = _req(50)
    partial.prefilled = 10
    queue = collections.deque([_req(3)])
    plan = plan_prefill(partial, queue, free=8, budget=16, admit=False)
    assert [(c.request, c.start, c.count) for c in plan] == [(partial, 10, 16)]
    assert len(queue) == 1
