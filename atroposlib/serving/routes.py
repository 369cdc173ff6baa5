"""The routes of ``atropos-serve-model``: thin handlers that read the
:class:`~atroposlib.serving.state.ServingState` from ``app.state.serving``, parse, call the
engine and answer. Declared once at module level on :data:`router`; ``create_app`` wires it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from atroposlib.http.openai_protocol import InvalidRequest, model_list, unless_disconnected
from atroposlib.serving.chat_templates import split_template_kwargs
from atroposlib.serving.loader import confine_weights_path
from atroposlib.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsRequest,
)
from atroposlib.serving.responses import chat_response, completion_response, generate_response
from atroposlib.serving.sampling import SamplingParams
from atroposlib.serving.state import ServingState, serving_state
from atroposlib.serving.streaming import stream_chat, stream_completions
from atroposlib.serving.weights_version import read_weights_version

logger = logging.getLogger(__name__)

router = APIRouter()


@router.get("/health")
async def health(st: ServingState = Depends(serving_state)) -> dict[str, Any]:
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


@router.get("/health_generate")
async def health_generate(st: ServingState = Depends(serving_state)) -> dict[str, Any]:
    ids = st.tokenizer.encode("hi", add_special_tokens=False) or [0]
    await st.engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
    return {"status": "ok", "version": st.engine.version}


@router.get("/v1/models")
async def models(st: ServingState = Depends(serving_state)) -> dict[str, Any]:
    return model_list(
        st.names,
        int(st.started),
        "atroposlib",
        root=st.config.model,
        max_model_len=st.engine.max_model_len,
        version=st.engine.version,
        weights_path=st.engine.weights_path,
    )


def _prompt_ids(st: ServingState, prompts: list[Any]) -> list[list[int]]:
    return [st.encode(p, True) if isinstance(p, str) else list(p) for p in prompts]


def _prompt_texts(st: ServingState, prompts: list[Any], echo: bool) -> list[str]:
    return [p if isinstance(p, str) else (st.tokenizer.decode(p) if echo else "") for p in prompts]


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, st: ServingState = Depends(serving_state)
) -> Response:
    name = st.check_model(body.model)
    params = body.sampling_params(
        st.config.max_n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs
    )
    prompts = body.prompts()
    ids_list = await st.off_loop(_prompt_ids, st, prompts)
    for ids in ids_list:  # validate every prompt before generating (or decoding) any
        st.engine.validate(ids, params)
    texts = await st.off_loop(_prompt_texts, st, prompts, body.echo)
    if body.stream:
        return stream_completions(st.engine, st.tokenizer, name, body, params, ids_list, texts)
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


@router.post("/v1/chat/completions")
async def chat(
    body: ChatCompletionRequest, request: Request, st: ServingState = Depends(serving_state)
) -> Response:
    name = st.check_model(body.model)
    top = body.top_logprobs or 0
    params = body.sampling_params(st.config.max_n, logprobs=top if body.logprobs else None)
    ids = await chat_prompt(st, body)
    if body.stream:
        st.engine.validate(ids, params)
        return stream_chat(st.engine, st.tokenizer, name, body, params, ids)
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


@router.post("/generate")
async def generate(
    body: GenerateRequest, request: Request, st: ServingState = Depends(serving_state)
) -> Response:
    st.check_model(body.model)
    params = body.sampling_params(
        st.config.max_n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs
    )
    if isinstance(body.prompt, str):
        text: str | None = body.prompt
        ids = await st.off_loop(st.encode, body.prompt, True)
    else:
        text, ids = None, list(body.prompt["prompt_token_ids"])
    result = await unless_disconnected(request, st.engine.generate(ids, params))
    return JSONResponse(generate_response(result, text, body.logprobs is not None))


@router.post("/update_weights")
async def update_weights(
    body: UpdateWeightsRequest, st: ServingState = Depends(serving_state)
) -> dict[str, Any]:
    path = confine_weights_path(body.path, st.weight_roots)
    version = body.version
    if version is None:  # the trainer's record beside the weights, when it is newer
        found = await st.off_loop(read_weights_version, path)
        version = found if found is not None and found > st.engine.version else None
    info = await st.engine.update_weights(path, version)
    return {**info, "model": st.name}


async def chat_prompt(st: ServingState, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the model's chat template, or the client's in the sandbox."""
    renderer = st.renderer
    template, variables = split_template_kwargs(
        body.chat_template_kwargs, body.chat_template, renderer is not None
    )
    messages = chat_messages(st.tokenizer, body, client_template=template is not None)
    if template is None:
        return await st.off_loop(render_chat, st, body, messages, variables)
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
    return await st.off_loop(st.encode, text, False, "messages")


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
