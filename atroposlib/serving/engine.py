"""The generation engine: one scheduler task that owns the model and its KV cache.

Concurrent requests share batched forward passes (continuous batching). The keys
and values live in one cache preallocated at start (:mod:`.kv_cache`): every
running sequence owns a slot of ``max_model_len`` positions, and the running
sequences occupy slots ``0 .. B-1``. A step is

1. one **decode** pass over those ``B`` rows: each feeds its last token at its own
   position, writes its keys/values into its slot in place, and attends to its own
   prefix (a per-row length mask); nothing is concatenated or reallocated;
2. one **prefill** pass of at most ``max_prefill_tokens`` (padded) prompt tokens:
   new prompts, and the next chunk of a prompt too long for one step, so a long
   prompt delays the running sequences by one bounded chunk per step instead of
   stalling them for its whole length. A prompt whose prefill spans steps is kept
   in a staging slot and copied to its decode slots when complete; ``n > 1`` copies
   the prompt's cache to all ``n`` slots (prefilled once).

A sequence leaves on its own eos / stop / ``max_tokens``; the last running slot
is then copied into the hole, so the running rows stay one contiguous block.
Requests wait in a queue until slots for all their ``n`` sequences are free, so
memory never grows past the cache sized at start. The model runs in one worker
thread, never on the event loop.

Failures are contained: a request whose sampling or bookkeeping fails is failed
alone while the others in the batch go on; when a forward pass itself fails,
exactly the requests in that pass get the error at once and the engine keeps
serving. No request is left waiting on a lost step.

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

With ``swap_in_place`` the loader only validates the checkpoint (names and shapes, from
the file headers) and returns an :class:`~.in_place.InPlaceUpdate`; at the swap point the
worker thread copies it tensor by tensor into the served model, with no step running.
The same drain/restart policy applies; the device never holds a second copy.

Here: the event-loop side (requests, admission, the scheduler task, weight swaps); the
worker-thread side (the passes, sampling, retiring rows, results) is
:class:`~atroposlib.serving.engine_step.EngineSteps`, a base class of :class:`Engine`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from atroposlib.http.openai_protocol import InvalidRequest
from atroposlib.http.openai_protocol import OpenAIError as ServingError
from atroposlib.serving.engine_step import EngineSteps, GenerationResult, SequenceOutput, TokenEvent
from atroposlib.serving.in_place import InPlaceUpdate
from atroposlib.serving.kv_cache import (
    STAGING_SLOTS,
    CachePlan,
    SlotKV,
    check_supported,
    kv_cache_line,
    plan_slots,
)
from atroposlib.serving.pause import record_served_version
from atroposlib.serving.sampling import SamplingParams, param_tensors
from atroposlib.serving.scheduler import Chunk, Request, Row, plan_prefill
from atroposlib.utils.aio import within
from atroposlib.utils.transformers_compat import prefer_sdpa

logger = logging.getLogger(__name__)


class Engine(EngineSteps):
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
        max_prefill_tokens: int = 2048,
        gpu_memory_fraction: float = 0.9,
        loader: Callable[[str], Any] | None = None,
        swap_drain_timeout: float = 30.0,
        swap_in_place: bool = False,
    ) -> None:
        check_supported(model.config)
        self.model = self._prepare(model)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.version = 0
        self.weights_path: str | None = None
        self._loader = loader
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._eos_ids = self._collect_eos_ids(model, tokenizer)
        self.cache_plan: CachePlan = plan_slots(
            model,
            max_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens,
            gpu_memory_fraction=gpu_memory_fraction,
            update_copy=not swap_in_place,
        )
        self.max_num_seqs = self.cache_plan.slots
        total = self.max_num_seqs + STAGING_SLOTS
        self.kv = SlotKV.for_model(model, total, max_model_len)
        self._staging = list(range(self.max_num_seqs, total))
        # Per-slot state, moved with the slot: (cached length, next input token, top_k)
        # and (temperature, top_p, min_p).
        self._slot_long = torch.zeros(total, 3, dtype=torch.long, device=self._device)
        self._slot_float = torch.zeros(total, 3, dtype=torch.float32, device=self._device)
        self._arange = torch.arange(max(max_model_len, total), device=self._device)
        text = model.config.get_text_config()
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        self._window = (
            int(text.sliding_window)
            if "sliding_attention" in kinds and text.sliding_window
            else None
        )
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Row] = []
        self._partial: Request | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._swap: tuple[Any, str, asyncio.Future] | None = None
        self._swap_since = 0.0
        self.swap_drain_timeout = swap_drain_timeout
        self._update_lock = asyncio.Lock()
        self.held = False
        self.parked = asyncio.Event()  # set while held and no step is running
        self.swap_log: list[dict[str, Any]] = []
        self._next_version: int | None = None
        self.restarted = 0
        self.torn_by: str | None = None  # an in-place copy that failed midway
        self.steps = 0
        self.prefill_passes = 0
        self.generated_tokens = 0
        logger.info(
            kv_cache_line(
                self.max_num_seqs,
                max_model_len,
                self.kv.nbytes,
                self._device,
                self._dtype,
                self.cache_plan.reason,
            )
        )

    def _prepare(self, model: Any) -> Any:
        """Use an attention implementation that takes the engine's 4D masks."""
        self._additive_mask = prefer_sdpa(model)
        return model

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
        self._fail_active(RuntimeError("server shutting down"))
        for req in self._waiting:
            if not req.future.done():
                req.future.set_exception(RuntimeError("server shutting down"))
        self._waiting.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def running(self) -> int:
        """Number of sequences being decoded or prefilled."""
        return len(self._rows) + (self._partial.params.n if self._partial else 0)

    @property
    def waiting(self) -> int:
        """Number of requests waiting for admission."""
        return len(self._waiting)

    def cache_info(self) -> dict[str, Any]:
        """Size and use of the KV cache (reported by ``/health``)."""
        return {
            "sequences": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "bytes": self.kv.nbytes,
            "bytes_per_sequence": self.cache_plan.bytes_per_slot,
            "device": str(self._device),
            "dtype": str(self._dtype).removeprefix("torch."),
            "sized_by": self.cache_plan.reason,
            "used_sequences": self.running,
            "max_prefill_tokens": self.max_prefill_tokens,
        }

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
        if params.n > self.max_num_seqs:
            raise InvalidRequest(
                f"n={params.n} sequences cannot run at once: the KV cache holds "
                f"{self.max_num_seqs} sequences",
                param="n",
            )
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
        if self.torn_by is not None:
            raise ServingError(
                f"the weights are partly from {self.torn_by!r} (an in-place update failed "
                "midway); POST /update_weights again",
                status=503,
            )
        max_tokens = self.validate(prompt_ids, params)
        try:
            temps, top_k, top_p, min_p = param_tensors([params])
        except (RuntimeError, OverflowError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"a sampling parameter is out of range: {exc}") from exc
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self._device)
            try:
                gen.manual_seed(params.seed)
            except (RuntimeError, OverflowError, ValueError) as exc:
                raise InvalidRequest(f"seed is out of range: {exc}", param="seed") from exc
        loop = asyncio.get_running_loop()
        req = Request(
            list(prompt_ids), params, max_tokens, loop.create_future(), gen, listener, loop
        )
        req.float_params = torch.stack([temps, top_p, min_p], dim=1)
        req.top_k = top_k
        self._waiting.append(req)
        self._wakeup.set()
        try:
            result = await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancelled = True
            raise
        record_served_version(result.version)
        return result

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (ids at or above it are rejected)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    async def update_weights(self, path: str, version: int | None = None) -> dict[str, Any]:
        """Load ``path`` off the hot path, then swap it in between steps (see module doc).

        ``version`` names the new weights (the trainer's step); it must be above the current
        version. Without it the version goes up by one.
        """
        if self._loader is None:
            raise InvalidRequest("this engine cannot load weights", param="path")
        async with self._update_lock:
            if version is not None and version <= self.version:
                raise InvalidRequest(
                    f"version {version} is not above the served version {self.version}",
                    param="version",
                )
            t0 = time.monotonic()
            new_model = await asyncio.to_thread(self._loader, path)
            loaded = time.monotonic()
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._next_version = version
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

    def hold(self) -> None:
        """Stop stepping: running sequences keep their cache slots and continue on
        :meth:`release` (new requests queue meanwhile)."""
        self.held = True
        self._wakeup.set()

    def release(self) -> None:
        """Undo :meth:`hold`."""
        self.held = False
        self.parked.clear()
        self._wakeup.set()

    # ----------------------------------------------------------------- scheduler
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._iterate(loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave a request waiting on a lost step
                logger.exception("engine step failed")
                self._fail_active(exc)

    def _active(self) -> bool:
        return bool(self._rows) or self._partial is not None

    async def _iterate(self, loop: asyncio.AbstractEventLoop) -> None:
        if (
            self._swap is not None
            and self._active()
            and time.monotonic() - self._swap_since > self.swap_drain_timeout
        ):
            self._restart_rows()
        if not self._active() and self._swap is not None:
            await self._apply_swap(loop)
            return
        if self.held:
            # Paused with in-flight requests kept (POST /pause mode "hold"): no step runs.
            # A pending swap is re-checked, so held rows are restarted after its drain timeout.
            self.parked.set()
            self._wakeup.clear()
            timeout = 0.05 if self._swap is not None else None
            try:
                await within(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            return
        plan = self._plan()
        if not plan and not self._rows:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        outcome = await loop.run_in_executor(self._executor, self._step, plan)
        for req, result in outcome.finished:
            if not req.future.done():
                req.future.set_result(result)
        for req, exc in outcome.failed:
            if not req.future.done():
                req.future.set_exception(exc)

    def _fail_active(self, exc: BaseException) -> None:
        """Fail every request with a sequence in the cache (the step they were in is lost)."""
        reqs = {id(r.request): r.request for r in self._rows}
        if self._partial is not None:
            reqs[id(self._partial)] = self._partial
        self._rows, self._partial = [], None
        for req in reqs.values():
            req.error = req.error or exc
            if not req.future.done():
                req.future.set_exception(exc)

    def _plan(self) -> list[Chunk]:
        if self._partial is not None and self._partial.cancelled:
            self._partial = None
        return plan_prefill(
            self._partial,
            self._waiting,
            free=self.max_num_seqs - len(self._rows),
            budget=self.max_prefill_tokens,
            admit=self._swap is None,
        )

    def _restart_rows(self) -> None:
        """Send running non-streamed requests back to the queue head, to re-run from scratch."""
        restart = {id(r.request): r.request for r in self._rows if r.request.listener is None}
        partial = self._partial
        if partial is not None:
            restart[id(partial)] = partial  # nothing of it was sent yet
            self._partial = None
        if not restart:
            return
        self._compact([i for i, r in enumerate(self._rows) if id(r.request) in restart])
        for req in reversed(list(restart.values())):
            req.reset()
            self._waiting.appendleft(req)
        self.restarted += len(restart)
        logger.info("restarting %d request(s) on the new weights", len(restart))

    async def _apply_swap(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._swap is not None
        model, path, fut = self._swap
        if isinstance(model, InPlaceUpdate):
            # Admission stays closed (``_swap`` is set) and no step runs while this copies.
            try:
                await loop.run_in_executor(self._executor, model.apply)
            except Exception as exc:
                logger.exception("in-place weight update from %s failed midway", path)
                self._swap, self._next_version = None, None
                self.torn_by = path
                if not fut.done():
                    fut.set_exception(exc)
                torn = ServingError(f"the weights are partly from {path!r}", status=503)
                for req in self._waiting:
                    if not req.future.done():
                        req.future.set_exception(torn)
                self._waiting.clear()
                return
            self.torn_by = None
            model = self.model
        self._swap = None
        self.model = self._prepare(model)
        self._eos_ids = self._collect_eos_ids(model, self.tokenizer)
        requested, self._next_version = self._next_version, None
        self.version = requested if requested is not None else self.version + 1
        self.weights_path = path
        self.swap_log.append({"version": self.version, "path": path, "time": time.time()})
        logger.info("serving weights version %d from %s", self.version, path)
        if not fut.done():
            fut.set_result(self.version)


__all__ = ["Engine", "GenerationResult", "SequenceOutput", "TokenEvent"]
