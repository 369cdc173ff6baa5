"""The generation engine: one scheduler task that owns the model.

Concurrent requests are merged into batched forward passes (continuous
batching): every step decodes one token for all running sequences at once,
and newly arrived prompts are prefilled in a batch and join the running batch
(their KV caches are left-padded and stacked, see :mod:`.kv_cache`). Each
sequence leaves the batch on its own eos / stop / ``max_tokens``. The model
runs in one worker thread, never on the event loop.

Weight updates (``update_weights``) load the new checkpoint in another thread
while generation continues; once loaded, the scheduler stops admitting new
requests, lets the running sequences **finish on the old weights**, swaps the
model and resumes. Sequences still running ``swap_drain_timeout`` seconds after
the new weights are ready are **restarted** instead (their tokens are discarded
and the request is re-run from its prompt, with its seed, on the new weights),
so one long generation cannot stall an update; streamed requests, whose tokens
were already sent, are always allowed to finish. Every response therefore comes
entirely from one version (reported as ``version``), and no sequence ever sees
a half-loaded model.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atroposlib.serving.errors import InvalidRequest
from atroposlib.serving.kv_cache import KVBatch, cache_tensors, make_cache
from atroposlib.serving.sampling import SamplingParams, prompt_logprobs, sample

logger = logging.getLogger(__name__)


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
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    future: asyncio.Future
    generator: torch.Generator | None
    listener: Callable[[TokenEvent], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    rows: list[_Row] = field(default_factory=list)
    open_rows: int = 0
    prompt_lps: list[dict[int, float] | None] | None = None
    cancelled: bool = False


@dataclass
class _Row:
    request: _Request
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped_by_string: bool = False


class Engine:
    """Continuous-batching generator over a Hugging Face causal LM.

    Example::

        engine = Engine(model, tokenizer, max_model_len=2048)
        await engine.start()
        result = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8))
        await engine.stop()
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        loader: Callable[[str], Any] | None = None,
        swap_drain_timeout: float = 30.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.version = 0
        self.weights_path: str | None = None
        self._loader = loader
        self._device = next(model.parameters()).device
        self._eos_ids = self._collect_eos_ids(model, tokenizer)
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._waiting: collections.deque[_Request] = collections.deque()
        self._rows: list[_Row] = []
        self._batch: KVBatch | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._swap: tuple[Any, str, asyncio.Future] | None = None
        self._swap_since = 0.0
        self.swap_drain_timeout = swap_drain_timeout
        self._update_lock = asyncio.Lock()
        self.restarted = 0
        self.steps = 0
        self.generated_tokens = 0

    @staticmethod
    def _collect_eos_ids(model: Any, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the scheduler task (call from the serving event loop)."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="engine-scheduler")

    async def stop(self) -> None:
        """Cancel the scheduler, fail waiting requests and release the worker thread."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for req in list(self._waiting) + [r.request for r in self._rows]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("server shutting down"))
        self._waiting.clear()
        self._rows = []
        self._batch = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def running(self) -> int:
        """Number of sequences being decoded."""
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Number of requests waiting for admission."""
        return len(self._waiting)

    # ------------------------------------------------------------------ requests
    def resolve_max_tokens(
        self, prompt_len: int, params: SamplingParams, param_name: str = "max_tokens"
    ) -> int:
        """Validate lengths against ``max_model_len``; return the effective max_tokens."""
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if prompt_len >= self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {prompt_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} tokens and {param_name}={params.max_tokens} were "
                f"requested",
                param=param_name,
                code="context_length_exceeded",
            )
        return params.max_tokens

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt (length, token ids) before queueing; return the effective max_tokens."""
        max_tokens = self.resolve_max_tokens(len(prompt_ids), params)
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return max_tokens

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        listener: Callable[[TokenEvent], None] | None = None,
    ) -> GenerationResult:
        """Queue a prompt and wait for its ``params.n`` completions.

        ``listener``, when given, is called on the event loop with a
        :class:`TokenEvent` for every generated token (used for streaming).
        """
        max_tokens = self.validate(prompt_ids, params)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self._device)
            gen.manual_seed(params.seed)
        loop = asyncio.get_running_loop()
        req = _Request(
            list(prompt_ids), params, max_tokens, loop.create_future(), gen, listener, loop
        )
        self._waiting.append(req)
        self._wakeup.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (ids at or above it are rejected)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    async def update_weights(self, path: str) -> dict[str, Any]:
        """Load ``path`` off the hot path, then swap it in between steps (see module doc)."""
        if self._loader is None:
            raise InvalidRequest("this engine cannot load weights", param="path")
        async with self._update_lock:
            t0 = time.monotonic()
            new_model = await asyncio.to_thread(self._loader, path)
            loaded = time.monotonic()
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._swap = (new_model, path, fut)
            self._swap_since = time.monotonic()
            self._wakeup.set()
            version = await fut
            return {
                "version": version,
                "path": path,
                "load_seconds": round(loaded - t0, 4),
                "swap_wait_seconds": round(time.monotonic() - loaded, 4),
            }

    # ----------------------------------------------------------------- scheduler
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if (
                self._swap is not None
                and self._rows
                and (time.monotonic() - self._swap_since > self.swap_drain_timeout)
            ):
                self._restart_rows()
            if not self._rows and self._swap is not None:
                self._apply_swap()
                continue
            if not self._rows and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admitted = [] if self._swap is not None else self._admit()
            if not admitted and not self._rows:
                continue
            try:
                done = await loop.run_in_executor(self._executor, self._step, admitted)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a model failure must fail the requests, not hang them
                logger.exception("generation step failed")
                failed = {id(r.request): r.request for r in self._rows}
                failed.update({id(r): r for r in admitted})
                self._rows, self._batch = [], None
                for req in failed.values():
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, result in done:
                if not req.future.done():
                    req.future.set_result(result)

    def _restart_rows(self) -> None:
        """Send running non-streamed requests back to the queue head, to re-run from scratch."""
        restart = {id(r.request): r.request for r in self._rows if r.request.listener is None}
        if not restart:
            return
        keep = [i for i, r in enumerate(self._rows) if id(r.request) not in restart]
        self._rows = [self._rows[i] for i in keep]
        self._batch = self._batch.select(keep) if keep and self._batch is not None else None
        for req in reversed(list(restart.values())):
            req.rows, req.open_rows, req.prompt_lps = [], 0, None
            if req.generator is not None and req.params.seed is not None:
                req.generator.manual_seed(req.params.seed)
            self._waiting.appendleft(req)
        self.restarted += len(restart)
        logger.info("restarting %d request(s) on the new weights", len(restart))

    def _apply_swap(self) -> None:
        assert self._swap is not None
        model, path, fut = self._swap
        self._swap = None
        self.model = model
        self._eos_ids = self._collect_eos_ids(model, self.tokenizer)
        self.version += 1
        self.weights_path = path
        logger.info("serving weights version %d from %s", self.version, path)
        if not fut.done():
            fut.set_result(self.version)

    def _admit(self) -> list[_Request]:
        admitted: list[_Request] = []
        rows = len(self._rows)
        longest = 0
        while self._waiting:
            req = self._waiting[0]
            if req.cancelled:
                self._waiting.popleft()
                continue
            longest_if = max(longest, len(req.prompt_ids))
            if admitted and (
                rows + req.params.n > self.max_num_seqs
                or longest_if * (len(admitted) + 1) > self.max_batched_tokens
            ):
                break
            if not admitted and self._rows and rows + req.params.n > self.max_num_seqs:
                break
            self._waiting.popleft()
            admitted.append(req)
            rows += req.params.n
            longest = longest_if
        return admitted

    # ------------------------------------------------------- worker-thread side
    @torch.inference_mode()
    def _step(self, admitted: list[_Request]) -> list[tuple[_Request, GenerationResult]]:
        self.steps += 1
        finished: list[tuple[_Request, GenerationResult]] = []
        for row in self._rows:
            if row.request.cancelled and row.finish_reason is None:
                row.finish_reason = "abort"
        if any(r.finish_reason for r in self._rows):
            self._drop_finished(finished)
        if self._rows:
            self._decode(finished)
        plain = [r for r in admitted if r.params.prompt_logprobs is None]
        if plain:
            self._prefill(plain, finished)
        for req in admitted:
            if req.params.prompt_logprobs is not None:
                self._prefill([req], finished)
        return finished

    def _forward(self, **kwargs: Any) -> Any:
        return self.model(use_cache=True, return_dict=True, **kwargs)

    def _decode(self, finished: list) -> None:
        assert self._batch is not None
        batch = self._batch
        inputs = torch.tensor([[row.tokens[-1]] for row in self._rows], device=self._device)
        mask = torch.cat([batch.mask, batch.mask.new_ones((batch.size, 1))], dim=1)
        out = self._forward(
            input_ids=inputs,
            attention_mask=mask,
            position_ids=batch.positions.unsqueeze(1),
            past_key_values=make_cache(batch.kv),
        )
        self._batch = KVBatch(cache_tensors(out.past_key_values), mask, batch.positions + 1)
        self._sample_rows(self._rows, out.logits[:, -1, :])
        self._drop_finished(finished)

    def _prefill(self, reqs: list[_Request], finished: list) -> None:
        lengths = [len(r.prompt_ids) for r in reqs]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor(
            [[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in reqs], device=self._device
        )
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        want_prompt_lps = reqs[0].params.prompt_logprobs is not None
        kwargs: dict[str, Any] = {}
        if self._keep_arg and not want_prompt_lps:
            kwargs["logits_to_keep"] = 1
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        if want_prompt_lps:
            reqs[0].prompt_lps = prompt_logprobs(
                out.logits[0], reqs[0].prompt_ids, reqs[0].params.prompt_logprobs or 0
            )
        expand = [i for i, r in enumerate(reqs) for _ in range(r.params.n)]
        new_rows = [_Row(r, j) for r in reqs for j in range(r.params.n)]
        for r in reqs:
            r.rows = [row for row in new_rows if row.request is r]
            r.open_rows = r.params.n
        fresh = KVBatch(
            cache_tensors(out.past_key_values), mask, torch.tensor(lengths, device=self._device)
        ).select(expand)
        self._sample_rows(
            new_rows,
            out.logits[:, -1, :].index_select(0, torch.tensor(expand, device=self._device)),
        )
        self._batch = KVBatch.merge(self._batch if self._rows else None, fresh)
        self._rows = self._rows + new_rows
        self._drop_finished(finished)

    def _sample_rows(self, rows: list[_Row], logits: torch.Tensor) -> None:
        params = [r.request.params for r in rows]
        histories = (
            [(r.request.prompt_ids, r.tokens) for r in rows]
            if any(p.has_penalties for p in params)
            else None
        )
        out = sample(logits, params, [r.request.generator for r in rows], histories)
        self.generated_tokens += len(rows)
        for row, token, lp, top in zip(rows, out.tokens, out.logprobs, out.top, strict=True):
            row.tokens.append(token)
            row.logprobs.append(lp)
            row.top.append(top)
            row.finish_reason = self._finish_reason(row)
            req = row.request
            if req.listener is not None and req.loop is not None and not req.cancelled:
                event = TokenEvent(row.index, token, lp, top, row.finish_reason)
                req.loop.call_soon_threadsafe(req.listener, event)

    def _finish_reason(self, row: _Row) -> str | None:
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

    def _drop_finished(self, finished: list) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        for row in self._rows:
            if row.finish_reason is not None:
                req = row.request
                req.open_rows -= 1
                if req.open_rows == 0 and not req.cancelled:
                    finished.append((req, self._result(req)))
        self._rows = [self._rows[i] for i in keep]
        self._batch = self._batch.select(keep) if keep and self._batch is not None else None

    def _text(self, row: _Row) -> str:
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

    def _result(self, req: _Request) -> GenerationResult:
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
