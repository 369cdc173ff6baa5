"""What the engine schedules: requests, their sequences, and the prefill plan of a step.

:func:`plan_prefill` is the admission policy, a pure function of the queue: FIFO,
a request is admitted only when slots for all of its ``n`` sequences are free
(it waits otherwise, so the cache never overflows), and one step prefills at most
``budget`` padded prompt tokens. Only the last chunk of a step may leave its
prompt unfinished, so at most one prompt is ever partly prefilled; it continues
first in the next step.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atroposlib.serving.sampling import SamplingParams


@dataclass
class Request:
    """One queued or running request: its prompt, parameters and progress."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    future: asyncio.Future
    generator: torch.Generator | None
    listener: Callable[[Any], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    rows: list[Row] = field(default_factory=list)
    open_rows: int = 0
    prompt_lps: list[dict[int, float] | None] | None = None
    cancelled: bool = False
    error: BaseException | None = None
    prefilled: int = 0
    staging: int | None = None
    float_params: torch.Tensor | None = None
    top_k: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget all progress (the request is re-run from its prompt)."""
        self.rows, self.open_rows, self.prompt_lps = [], 0, None
        self.prefilled, self.staging = 0, None
        if self.generator is not None and self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)


@dataclass
class Row:
    """One generated sequence of a request (``n > 1`` gives ``n`` rows)."""

    request: Request
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False

    @property
    def cached(self) -> int:
        """Positions of this sequence already in its slot (its last token is not yet)."""
        return len(self.request.prompt_ids) + len(self.tokens) - 1


@dataclass(frozen=True)
class Chunk:
    """``count`` prompt tokens of ``request`` from ``start``, prefilled in one step."""

    request: Request
    start: int
    count: int

    @property
    def completes(self) -> bool:
        return self.start + self.count == len(self.request.prompt_ids)


def plan_prefill(
    partial: Request | None,
    waiting: collections.deque[Request],
    *,
    free: int,
    budget: int,
    admit: bool,
) -> list[Chunk]:
    """Choose this step's prefill chunks, popping admitted requests from ``waiting``.

    ``partial`` is the request whose prompt is partly prefilled (its next chunk comes
    first), ``free`` the sequence slots not in use, ``budget`` the padded token budget
    (rows x widest chunk), and ``admit`` false while a weight swap drains the engine.
    Cancelled requests at the head of the queue are dropped.
    """
    plan: list[Chunk] = []
    width = 0
    staging_busy = False
    if partial is not None:
        left = len(partial.prompt_ids) - partial.prefilled
        plan.append(Chunk(partial, partial.prefilled, min(left, budget)))
        width = plan[0].count
        staging_busy = not plan[0].completes
        free -= partial.params.n
    if not admit:
        return plan
    while waiting:
        req = waiting[0]
        if req.cancelled:
            waiting.popleft()
            continue
        if req.params.n > free:
            break  # waits for slots; FIFO keeps large requests from starving
        length = len(req.prompt_ids)
        rows = len(plan) + 1
        if rows * max(width, length) <= budget:
            plan.append(Chunk(req, 0, length))
            width = max(width, length)
        else:
            part = budget // rows
            if staging_busy or part < 1 or width > part:
                break
            plan.append(Chunk(req, 0, min(length, part)))
            width = max(width, plan[-1].count)
            staging_busy = True
        waiting.popleft()
        free -= req.params.n
        if staging_busy:
            break
    return plan
