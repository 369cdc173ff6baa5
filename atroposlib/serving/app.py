"""HTTP routes of ``atropos-serve-model``: parse, call the engine, answer.

Endpoints: ``GET /health``, ``GET /health_generate``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, the vLLM-style
``POST /generate`` used by ``VLLMServer`` and ``POST /update_weights``; ``POST /pause``,
``POST /resume`` and ``GET /weights_history`` (see :mod:`.pause`).

Security (docs/design.md, "Security model"): :func:`atroposlib.http.server.build_server`
puts the shared guard, CORS, bearer auth and body bounds in front of the routes, answering
in OpenAI's error format; templating and tokenising run in a thread pool, client chat templates in a sandboxed
process (:mod:`.chat_templates`), and weight updates only from ``--weights-root``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.openai_protocol import (
    InvalidRequest,
    ModelNotFound,
    completion_body,
    install_error_handlers,
    model_list,
    unless_disconnected,
)
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.serving.chat_templates import ClientTemplateRenderer, split_template_kwargs
from atroposlib.serving.config import ServeModelConfig
from atroposlib.serving.engine import Engine, SequenceOutput, TokenEvent
from atroposlib.serving.in_place import plan_in_place
from atroposlib.serving.loader import (
    confine_weights_path,
    load_compatible,
    load_model,
    load_tokenizer,
    prompt_char_limit,
    resolve_device,
    resolve_dtype,
    weight_roots,
)
from atroposlib.serving.pause import PauseGate, PauseMiddleware, install_pause_routes
from atroposlib.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsRequest,
)
from atroposlib.serving.responses import (
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    generate_response,
    usage,
)
from atroposlib.serving.sampling import SamplingParams
from atroposlib.serving.streaming import stream_choices
from atroposlib.serving.weights_version import read_weights_version

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServingState:
    """Everything the routes need: the engine, the tokenizer and the names served."""

    config: ServeModelConfig
    engine: Engine
    tokenizer: Any
    names: list[str]
    started: float
    max_prompt_chars: int | None = None

    @property
    def name(self) -> str:
        """The primary served model name."""
        return self.names[0]

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse text that cannot fit the context whatever it tokenises to, before tokenising.

        Tokenising megabytes costs seconds of CPU; every token covers at most
        :func:`~.loader.prompt_char_limit`'s share of characters, so longer text is a sure 400.
        """
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the {param} has {len(text)} characters, more than can fit",
                param=param,
                code="context_length_exceeded",
            )


def build_state(config: ServeModelConfig) -> ServingState:
    """Load model and tokenizer per ``config`` and wrap them in an engine (blocking)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, device, dtype)
    if device.type == "cpu":
        small = sum(p.numel() for p in model.parameters()) < 100_000_000
        torch.set_num_threads(config.cpu_threads or (1 if small else torch.get_num_threads()))
    limit = getattr(model.config, "max_position_embeddings", None) or 4096
    max_len = config.max_model_len or int(limit)
    engine = Engine(
        model,
        tokenizer,
        max_model_len=max_len,
        max_num_seqs=config.max_num_seqs,
        max_prefill_tokens=config.max_prefill_tokens,
        gpu_memory_fraction=config.gpu_memory_fraction,
        swap_drain_timeout=config.swap_drain_timeout,
        swap_in_place=config.swap_in_place,
        loader=(
            (lambda path: plan_in_place(path, engine.model))
            if config.swap_in_place
            else (lambda path: load_compatible(path, engine.model, device, dtype))
        ),
    )
    engine.version = read_weights_version(config.model) or 0
    logger.info("loaded %s on %s (%s), max_model_len=%d", config.model, device, dtype, max_len)
    return ServingState(
        config,
        engine,
        tokenizer,
        list(config.served_model_name or [config.model]),
        time.time(),
        prompt_char_limit(tokenizer, max_len),
    )


def create_app(config: ServeModelConfig, state: ServingState | None = None) -> FastAPI:
    """Build the FastAPI app; the model is loaded at startup unless ``state`` is given."""

    roots = weight_roots(config)
    # Templating and tokenising take up to seconds for long prompts: never on the event loop.
    prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prep")
    renderer = (
        ClientTemplateRenderer(
            timeout=config.client_template_timeout, max_chars=config.client_template_max_chars
        )
        if config.allow_client_chat_template
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st = state or await asyncio.to_thread(build_state, config)
        app.state.serving = st
        await st.engine.start()
        try:
            yield
        finally:
            await st.engine.stop()
            if renderer is not None:
                await renderer.close()
            prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="atropos-serve-model", lifespan=lifespan)
    install_error_handlers(app)
    pause_gate = PauseGate()
    app.add_middleware(PauseMiddleware, gate=pause_gate)  # innermost: after the stack below
    build_server(
        app,
        ServerOptions(
            bind_host=config.host,
            api_key=config.api_key,
            allowed_origins=tuple(config.cors_origin or ()),
            max_body_bytes=int(config.max_request_mb * 2**20),
            body_timeout=config.body_timeout,
            shape=openai_error_bytes,
        ),
    )

    async def get_state(request: Request) -> ServingState:
        # async: FastAPI runs a plain ``def`` dependency in its thread pool, a hand-off that
        # costs more CPU per request than the lookup itself.
        return request.app.state.serving

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(prep, functools.partial(fn, *args))

    def encode(st: ServingState, text: str, special: bool, param: str = "prompt") -> list[int]:
        st.check_prompt_chars(text, param)
        return st.tokenizer.encode(text, add_special_tokens=special)

    async def chat_prompt(st: ServingState, body: ChatCompletionRequest) -> list[int]:
        template, variables = split_template_kwargs(
            body.chat_template_kwargs, body.chat_template, renderer is not None
        )
        messages = chat_messages(st.tokenizer, body, client_template=template is not None)
        if template is None:
            return await off_loop(render_chat, st, body, messages, variables)
        assert renderer is not None
        text = await renderer.render(
            template,
            {
                **special_tokens(st.tokenizer),
                **variables,
                "messages": messages,
                "tools": body.tools,
                "add_generation_prompt": body.add_generation_prompt,
            },
            body.continue_final_message,
        )
        return await off_loop(encode, st, text, False, "messages")

    def check_model(st: ServingState, model: str | None) -> str:
        if model is None or model in st.names:
            return model or st.name
        if os.path.isdir(st.config.model) and os.path.realpath(model) == os.path.realpath(
            st.config.model
        ):
            return model  # the same local directory spelled differently
        raise ModelNotFound(
            f"The model `{model}` does not exist. Served: {st.names}",
            param="model",
            code="model_not_found",
        )

    @app.get("/health")
    async def health(st: ServingState = Depends(get_state)) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": st.name,
            "version": st.engine.version,
            "running": st.engine.running,
            "waiting": st.engine.waiting,
            "steps": st.engine.steps,
            "generated_tokens": st.engine.generated_tokens,
            "restarted_on_update": st.engine.restarted,
            "kv_cache": st.engine.cache_info(),
        }

    @app.get("/health_generate")
    async def health_generate(st: ServingState = Depends(get_state)) -> dict[str, Any]:
        ids = st.tokenizer.encode("hi", add_special_tokens=False) or [0]
        await st.engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
        return {"status": "ok", "version": st.engine.version}

    @app.get("/v1/models")
    async def models(st: ServingState = Depends(get_state)) -> dict[str, Any]:
        return model_list(
            st.names,
            int(st.started),
            "atroposlib",
            root=st.config.model,
            max_model_len=st.engine.max_model_len,
            version=st.engine.version,
            weights_path=st.engine.weights_path,
        )

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, st: ServingState = Depends(get_state)
    ) -> Response:
        name = check_model(st, body.model)
        params = body.sampling_params(
            st.config.max_n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs
        )
        prompts = body.prompts()
        ids_list = await off_loop(
            lambda: [encode(st, p, True) if isinstance(p, str) else list(p) for p in prompts]
        )
        for ids in ids_list:  # validate every prompt before generating (or decoding) any
            st.engine.validate(ids, params)
        texts = await off_loop(
            lambda: [
                p if isinstance(p, str) else (st.tokenizer.decode(p) if body.echo else "")
                for p in prompts
            ]
        )
        if body.stream:
            return stream_completions(st, name, body, params, ids_list, texts)
        results = await unless_disconnected(
            request, asyncio.gather(*(st.engine.generate(ids, params) for ids in ids_list))
        )
        return JSONResponse(
            completion_response(
                name,
                st.tokenizer,
                list(results),
                texts,
                body.logprobs is not None,
                body.echo,
                body.return_tokens_as_token_ids,
            )
        )

    @app.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest, request: Request, st: ServingState = Depends(get_state)
    ) -> Response:
        name = check_model(st, body.model)
        top = body.top_logprobs or 0
        params = body.sampling_params(st.config.max_n, logprobs=top if body.logprobs else None)
        ids = await chat_prompt(st, body)
        if body.stream:
            st.engine.validate(ids, params)
            return stream_chat(st, name, body, params, ids)
        result = await unless_disconnected(request, st.engine.generate(ids, params))
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        return JSONResponse(
            chat_response(
                name,
                st.tokenizer,
                result,
                body.logprobs,
                parse_tools,
                body.return_tokens_as_token_ids,
            )
        )

    @app.post("/generate")
    async def generate(
        body: GenerateRequest, request: Request, st: ServingState = Depends(get_state)
    ) -> Response:
        check_model(st, body.model)
        params = body.sampling_params(
            st.config.max_n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs
        )
        if isinstance(body.prompt, str):
            text: str | None = body.prompt
            ids = await off_loop(encode, st, body.prompt, True)
        else:
            text, ids = None, list(body.prompt["prompt_token_ids"])
        result = await unless_disconnected(request, st.engine.generate(ids, params))
        return JSONResponse(generate_response(result, text, body.logprobs is not None))

    @app.post("/update_weights")
    async def update_weights(
        body: UpdateWeightsRequest, st: ServingState = Depends(get_state)
    ) -> dict[str, Any]:
        path = confine_weights_path(body.path, roots)
        version = body.version
        if version is None:  # the trainer's record beside the weights, when it is newer
            found = await off_loop(read_weights_version, path)
            version = found if found is not None and found > st.engine.version else None
        info = await st.engine.update_weights(path, version)
        return {**info, "model": st.name}

    install_pause_routes(app, pause_gate, get_state)
    return app


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special-token variables (``bos_token``, ``eos_token``, ...) templates expect."""
    return dict(getattr(tokenizer, "special_tokens_map", None) or {})


def chat_messages(
    tokenizer: Any, body: ChatCompletionRequest, client_template: bool = False
) -> list[dict[str, Any]]:
    """The request's messages as template input, after the checks every template needs."""
    if not client_template and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model's tokenizer has no chat template; use /v1/completions", param="messages"
        )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    if body.continue_final_message and messages[-1]["role"] != "assistant":
        raise InvalidRequest(
            "'continue_final_message' needs a final assistant message", param="messages"
        )
    return messages


def render_chat(
    st: ServingState,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
) -> list[int]:
    """Apply the model's own chat template (with tools) and tokenize (blocking: run off-loop)."""
    try:
        text = st.tokenizer.apply_chat_template(
            messages,
            tools=body.tools,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **variables,
        )
    except Exception as exc:  # the template is trusted; what fails it is the client's input
        logger.info("chat template failed on a request: %s: %s", type(exc).__name__, exc)
        raise InvalidRequest(
            f"cannot render the chat template: {type(exc).__name__}: {exc}", param="messages"
        ) from exc
    st.check_prompt_chars(text, "messages")
    return st.tokenizer.encode(text, add_special_tokens=False)


def _events_output(events: list[TokenEvent]) -> SequenceOutput:
    return SequenceOutput(
        0,
        [e.token_id for e in events],
        "",
        [e.logprob for e in events],
        [e.top_logprobs for e in events],
        "",
    )


def _usage_requested(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _chunk_envelope(object_name: str, name: str) -> Callable[..., dict[str, Any]]:
    """``wrap(choices, **extra)``: one stream's chunks, all with the same id and time."""
    head = completion_body(object_name, name, [])

    def wrap(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": choices, **extra}

    return wrap


def _sse(
    st: ServingState,
    body: ChatCompletionRequest | CompletionRequest,
    params: SamplingParams,
    prompts: list[list[int]],
    wrap: Callable[..., dict[str, Any]],
    chunk: Callable[[int, str, list[TokenEvent], str | None], dict[str, Any]],
    first: Callable[[int], dict[str, Any]] | None,
) -> StreamingResponse:
    """The SSE answer streaming ``prompts``, with a usage chunk when the client asked."""

    def usage_chunk(results: list) -> dict[str, Any]:
        return wrap([], usage=usage(results))

    gen = stream_choices(
        st.engine,
        prompts,
        params,
        st.tokenizer,
        chunk,
        first,
        usage_chunk if _usage_requested(body) else None,
    )
    return StreamingResponse(gen, media_type="text/event-stream")


def stream_chat(
    st: ServingState, name: str, body: ChatCompletionRequest, params: SamplingParams, ids: list[int]
) -> StreamingResponse:
    """SSE ``chat.completion.chunk`` stream for one conversation."""
    as_ids = body.return_tokens_as_token_ids
    wrap = _chunk_envelope("chat.completion.chunk", name)

    def first(idx: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return wrap([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])

    def chunk(idx: int, delta: str, events: list[TokenEvent], finish: str | None) -> dict:
        lps = chat_logprobs(st.tokenizer, _events_output(events), as_ids) if body.logprobs else None
        return wrap(
            [
                {
                    "index": idx,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": lps,
                    "finish_reason": finish,
                }
            ]
        )

    return _sse(st, body, params, [ids], wrap, chunk, first)


def stream_completions(
    st: ServingState,
    name: str,
    body: CompletionRequest,
    params: SamplingParams,
    ids_list: list[list[int]],
    texts: list[str],
) -> StreamingResponse:
    """SSE ``text_completion`` stream; choice index = prompt index * n + i."""
    as_ids = body.return_tokens_as_token_ids
    wrap = _chunk_envelope("text_completion", name)
    echoed: set[int] = set()

    def chunk(idx: int, delta: str, events: list[TokenEvent], finish: str | None) -> dict:
        if body.echo and idx not in echoed:
            echoed.add(idx)
            delta = texts[idx // params.n] + delta
        lps = (
            completion_logprobs(st.tokenizer, _events_output(events), 0, as_ids)
            if body.logprobs is not None
            else None
        )
        return wrap([{"index": idx, "text": delta, "logprobs": lps, "finish_reason": finish}])

    return _sse(st, body, params, ids_list, wrap, chunk, None)
