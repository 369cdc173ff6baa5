"""The engine's worker-thread side: one step's decode and prefill passes, and its results.

:class:`EngineSteps` is the part of :class:`~atroposlib.serving.engine.Engine` that runs in
its worker thread (never on the event loop): :meth:`~EngineSteps._step` retires finished
rows, runs one **decode** pass over the running rows and one **prefill** pass over the
step's prompt chunks (each writing its keys and values into the slot cache in place),
samples one token per row and records it (a streaming listener hears of it on the event
loop), and hands back the requests that finished or failed. A failed pass fails exactly
the requests in it; a failed sample is retried row by row, so only the rows that fail by
themselves fail. Rows leaving the batch are compacted so the running rows stay slots
``0 .. B-1``. The module docstring of :mod:`atroposlib.serving.engine` describes a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from atroposlib.serving.sampling import prompt_logprob_entries, sample
from atroposlib.serving.scheduler import Chunk, Request, Row
from atroposlib.utils.transformers_compat import forward_with_cache

if TYPE_CHECKING:
    from atroposlib.serving.kv_cache import SlotKV

# The engine's own logger: the engine logs under one name, whichever part of it speaks.
logger = logging.getLogger("atroposlib.serving.engine")

__all__ = ["EngineSteps", "GenerationResult", "SequenceOutput", "TokenEvent"]


@dataclass
class SequenceOutput:
    """One generated choice."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str


@dataclass
class GenerationResult:
    """Everything a request produced, plus the weight version that produced it."""

    prompt_ids: list[int]
    outputs: list[SequenceOutput]
    prompt_logprobs: list[dict[int, float] | None] | None
    version: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, delivered to a streaming listener on the event loop."""

    index: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None


@dataclass
class _Outcome:
    """What a step hands back to the event loop."""

    finished: list[tuple[Request, GenerationResult]] = field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)


class EngineSteps:
    """The worker-thread side of :class:`~atroposlib.serving.engine.Engine` (a base class
    of it; the attributes below are the engine's)."""

    model: Any
    tokenizer: Any
    kv: SlotKV
    max_model_len: int
    version: int
    steps: int
    prefill_passes: int
    generated_tokens: int
    _rows: list[Row]
    _partial: Request | None
    _staging: list[int]
    _slot_long: torch.Tensor
    _slot_float: torch.Tensor
    _arange: torch.Tensor
    _window: int | None
    _additive_mask: bool
    _device: torch.device
    _dtype: torch.dtype
    _eos_ids: set[int]

    @torch.inference_mode()
    def _step(self, plan: list[Chunk]) -> _Outcome:
        self.steps += 1
        out = _Outcome()
        self._retire(out)
        if self._rows:
            try:
                self._decode(out)
            except Exception as exc:  # the pass is lost: its requests fail, nothing else
                logger.exception("decode pass failed")
                self._fail_rows(list(range(len(self._rows))), exc, out)
            self._retire(out)
        if plan:
            try:
                self._prefill(plan, out)
            except Exception as exc:
                logger.exception("prefill pass failed")
                for chunk in plan:
                    self._fail(chunk.request, exc, out)
                if self._partial is not None and self._partial.error is not None:
                    self._partial = None
            self._retire(out)
        return out

    def _fail(self, req: Request, exc: BaseException, out: _Outcome) -> None:
        if req.error is None:
            req.error = exc
            out.failed.append((req, exc))

    def _fail_rows(self, indices: list[int], exc: BaseException, out: _Outcome) -> None:
        for i in indices:
            self._fail(self._rows[i].request, exc, out)

    def _mask(self, positions: torch.Tensor, length: int) -> Any:
        """Attention mask ``[rows, 1, q, length]``: a query at position p sees keys 0..p."""
        keys = self._arange[:length]
        pos = positions.unsqueeze(-1).unsqueeze(1)
        allowed = keys <= pos
        masks = {"full_attention": allowed}
        if self._window is not None:
            masks["sliding_attention"] = allowed & (keys > pos - self._window)
        if self._additive_mask:
            floor = torch.finfo(self._dtype).min
            masks = {
                k: torch.zeros(m.shape, dtype=self._dtype, device=m.device).masked_fill_(~m, floor)
                for k, m in masks.items()
            }
        return masks if self._window is not None else masks["full_attention"]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, keep: int) -> Any:
        mask = self._mask(positions, cache.length)
        return forward_with_cache(self.model, ids, positions, mask, cache, keep)

    def _decode(self, out: _Outcome) -> None:
        rows = self._rows
        batch = len(rows)
        length = max(r.cached for r in rows) + 1
        lens = self._slot_long[:batch, 0]
        cache = self.kv.pass_view(slice(0, batch), self._arange[:batch], lens, length)
        ids = self._slot_long[:batch, 1].unsqueeze(1)
        logits = self._forward(ids, lens.unsqueeze(1), cache, 1)[:, -1]
        lens += 1
        self._sample_rows(rows, logits, 0, out)

    def _prefill(self, plan: list[Chunk], out: _Outcome) -> None:
        """One pass over this step's prompt chunks (left-padded to a common width)."""
        self.prefill_passes += 1
        device = self._device
        base = dest = len(self._rows)
        slots: list[int] = []
        targets: list[int] = []  # first decode slot of each completing chunk, else -1
        busy = {c.request.staging for c in plan if c.request.staging is not None}
        for chunk in plan:
            req = chunk.request
            if chunk.start == 0 and chunk.completes:
                slots.append(dest)
            else:
                if req.staging is None:
                    req.staging = next(s for s in self._staging if s not in busy)
                    busy.add(req.staging)
                slots.append(req.staging)
            if chunk.completes:
                targets.append(dest)
                dest += req.params.n
            else:
                targets.append(-1)
        width = max(c.count for c in plan)
        ids, pos, write_slots, write_pos, source = [], [], [], [], []
        for i, chunk in enumerate(plan):
            pad = width - chunk.count
            prompt = chunk.request.prompt_ids
            ids.append([0] * pad + prompt[chunk.start : chunk.start + chunk.count])
            span = list(range(chunk.start, chunk.start + chunk.count))
            pos.append([0] * pad + span)
            write_slots += [slots[i]] * chunk.count
            write_pos += span
            source += range(i * width + pad, (i + 1) * width)
        length = max(c.start + c.count for c in plan)
        rows: slice | torch.Tensor
        if slots == list(range(slots[0], slots[0] + len(slots))):
            rows = slice(slots[0], slots[0] + len(slots))
        else:
            rows = torch.tensor(slots, device=device)
        cache = self.kv.pass_view(
            rows,
            torch.tensor(write_slots, device=device),
            torch.tensor(write_pos, device=device),
            length,
            None if len(source) == len(plan) * width else torch.tensor(source, device=device),
        )
        want_lps = any(c.request.params.prompt_logprobs is not None for c in plan)
        logits = self._forward(
            torch.tensor(ids, device=device),
            torch.tensor(pos, device=device),
            cache,
            0 if want_lps else 1,
        )
        new_rows: list[Row] = []
        pick: list[int] = []
        for i, chunk in enumerate(plan):
            req = chunk.request
            try:
                if req.params.prompt_logprobs is not None:
                    self._chunk_prompt_logprobs(chunk, logits[i, width - chunk.count :])
                req.prefilled = chunk.start + chunk.count
                if not chunk.completes:
                    self._partial = req
                    continue
                if self._partial is req:
                    self._partial = None
                n = req.params.n
                first = targets[i]
                prompt_len = len(req.prompt_ids)
                if slots[i] != first:
                    self.kv.fork(slots[i], list(range(first, first + n)), prompt_len)
                elif n > 1:
                    self.kv.fork(first, list(range(first + 1, first + n)), prompt_len)
                req.staging = None
                self._slot_float[first : first + n] = req.float_params.to(device).expand(n, 3)
                self._slot_long[first : first + n, 2] = req.top_k.to(device).expand(n)
                self._slot_long[first : first + n, 0] = prompt_len
                req.rows = [Row(req, j) for j in range(n)]
                req.open_rows = n
            except Exception as exc:  # e.g. prompt logprobs of this request alone
                logger.exception("prefill of one request failed")
                self._fail(req, exc, out)
                if self._partial is req:
                    self._partial = None
                req.rows = [Row(req, j, finish_reason="error") for j in range(req.params.n)]
                req.open_rows = req.params.n
            if chunk.completes:
                new_rows += req.rows
                pick += [i] * req.params.n
        if new_rows:
            self._rows += new_rows
            last = logits[:, -1].index_select(0, torch.tensor(pick, device=device))
            self._sample_rows(new_rows, last, base, out)

    def _chunk_prompt_logprobs(self, chunk: Chunk, logits: torch.Tensor) -> None:
        req = chunk.request
        prompt = req.prompt_ids
        if chunk.start == 0:
            req.prompt_lps = [None]
        assert req.prompt_lps is not None
        usable = min(chunk.count, len(prompt) - 1 - chunk.start)
        req.prompt_lps += prompt_logprob_entries(
            logits[:usable],
            prompt[chunk.start + 1 : chunk.start + 1 + usable],
            req.params.prompt_logprobs or 0,
        )

    def _sample_rows(
        self, rows: list[Row], logits: torch.Tensor, first: int, out: _Outcome
    ) -> None:
        """Sample one token for ``rows`` (slots ``first..``) and record it.

        If batched sampling fails, each row is retried alone so that only the
        rows that fail by themselves fail (with their requests).
        """
        span = slice(first, first + len(rows))
        params = [r.request.params for r in rows]
        gens = [r.request.generator for r in rows]
        histories = (
            [(r.request.prompt_ids, r.tokens) for r in rows]
            if any(p.has_penalties for p in params)
            else None
        )
        tensors = (
            self._slot_float[span, 0],
            self._slot_long[span, 2],
            self._slot_float[span, 1],
            self._slot_float[span, 2],
        )
        errors: dict[int, BaseException] = {}
        try:
            res = self._sample(logits, params, gens, histories, tensors)
            picks = list(zip(res.tokens, res.logprobs, res.top, strict=True))
            assert res.token_tensor is not None
            self._slot_long[span, 1] = res.token_tensor
        except Exception:
            logger.exception("batched sampling failed; sampling each sequence alone")
            picks = []
            for i in range(len(rows)):
                one = slice(i, i + 1)
                try:
                    r = self._sample(
                        logits[one],
                        params[one],
                        gens[one],
                        histories[one] if histories is not None else None,
                        tuple(t[one] for t in tensors),  # type: ignore[arg-type]
                    )
                    picks.append((r.tokens[0], r.logprobs[0], r.top[0]))
                except Exception as exc:
                    errors[i] = exc
                    picks.append((0, 0.0, []))
            self._slot_long[span, 1] = torch.tensor([p[0] for p in picks], device=self._device)
        for i, (row, (token, lp, top)) in enumerate(zip(rows, picks, strict=True)):
            req = row.request
            if i in errors:
                self._fail(req, errors[i], out)
                continue
            if req.error is not None:
                continue
            try:
                self._record(row, token, lp, top)
            except Exception as exc:
                logger.exception("recording a token failed")
                self._fail(req, exc, out)
        self.generated_tokens += len(rows) - len(errors)

    def _sample(self, logits, params, gens, histories, tensors):  # type: ignore[no-untyped-def]
        """The sampling call (one place, so a test can make it fail for chosen rows)."""
        return sample(logits, params, gens, histories, tensors)

    def _record(self, row: Row, token: int, lp: float, top: list[tuple[int, float]]) -> None:
        row.tokens.append(token)
        row.logprobs.append(lp)
        row.top.append(top)
        row.finish_reason = self._finish_reason(row)
        req = row.request
        if req.listener is not None and req.loop is not None and not req.cancelled:
            event = TokenEvent(row.index, token, lp, top, row.finish_reason)
            req.loop.call_soon_threadsafe(req.listener, event)

    def _retire(self, out: _Outcome) -> None:
        """Remove finished, failed and cancelled rows; answer requests whose rows are all done."""
        gone = [
            i
            for i, r in enumerate(self._rows)
            if r.finish_reason is not None or r.request.error is not None or r.request.cancelled
        ]
        if not gone:
            return
        for i in gone:
            row = self._rows[i]
            req = row.request
            row.finish_reason = row.finish_reason or "abort"
            req.open_rows -= 1
            if req.open_rows == 0 and req.error is None and not req.cancelled:
                out.finished.append((req, self._result(req)))
        self._compact(gone)

    @torch.inference_mode()
    def _compact(self, gone: list[int]) -> None:
        """Drop rows ``gone`` and move the last rows into their slots (one contiguous block)."""
        rows = self._rows
        keep = len(rows) - len(gone)
        gone_set = set(gone)
        holes = [i for i in gone if i < keep]
        movers = [i for i in range(keep, len(rows)) if i not in gone_set]
        if holes:
            length = max(rows[i].cached for i in movers)
            self.kv.move(holes, movers, length)
            h = torch.tensor(holes, device=self._device)
            m = torch.tensor(movers, device=self._device)
            self._slot_long[h] = self._slot_long[m]
            self._slot_float[h] = self._slot_float[m]
            for dst, src in zip(holes, movers, strict=True):
                rows[dst] = rows[src]
        del rows[keep:]

    def _finish_reason(self, row: Row) -> str | None:
        req, token = row.request, row.tokens[-1]
        p = req.params
        if (token in self._eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if p.stop:
            window = max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(
                row.tokens[-window:], skip_special_tokens=p.skip_special_tokens
            )
            if any(s in tail for s in p.stop):
                row.stopped_by_string = True
                return "stop"
        if len(row.tokens) >= req.max_tokens:
            return "length"
        if len(req.prompt_ids) + len(row.tokens) >= self.max_model_len:
            return "length"
        return None

    def _text(self, row: Row) -> str:
        p = row.request.params
        tokens = row.tokens
        ends_on_stop_token = (
            row.finish_reason == "stop"
            and not row.stopped_by_string
            and not p.include_stop_str_in_output
        )
        text = self.tokenizer.decode(
            tokens[:-1] if ends_on_stop_token else tokens, skip_special_tokens=p.skip_special_tokens
        )
        if row.stopped_by_string:
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                pos, stop = min(hits)
                text = text[: pos + (len(stop) if p.include_stop_str_in_output else 0)]
        return text

    def _result(self, req: Request) -> GenerationResult:
        outputs = [
            SequenceOutput(
                row.index,
                list(row.tokens),
                self._text(row),
                list(row.logprobs),
                list(row.top),
                row.finish_reason or "stop",
            )
            for row in req.rows
        ]
        return GenerationResult(req.prompt_ids, outputs, req.prompt_lps, self.version)
