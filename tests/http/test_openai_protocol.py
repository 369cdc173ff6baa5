"""The one OpenAI protocol module: error envelope and handlers, strict and pass-through models."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from atroposlib.http.answers import openai_error_type
from atroposlib.http.openai_protocol import (
    ClientGone,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    OpenAIError,
    PassThroughChatRequest,
    PassThroughCompletionRequest,
    StrictChatRequest,
    completion_body,
    install_error_handlers,
    model_list,
    passthrough,
    usage_body,
    validation_error,
)


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/forbidden")
    async def forbidden() -> dict:
        raise Forbidden("weights outside --weights-root", param="path")

    @app.get("/teapot")
    async def teapot() -> dict:
        raise OpenAIError("short and stout", status=418, type="teapot_error")

    @app.get("/bug")
    async def bug() -> dict:
        raise RuntimeError("boom")

    @app.post("/chat")
    async def chat(body: StrictChatRequest) -> dict:
        return {"n": body.n}

    return app


async def test_every_error_answers_in_the_envelope():
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        forbidden = await client.get("/forbidden")
        teapot = await client.get("/teapot")
        missing = await client.get("/nowhere")
        bad = await client.post(
            "/chat", json={"messages": [{"role": "user", "content": "x"}], "n": 0}
        )
        bug = await client.get("/bug")
    assert forbidden.status_code == 403
    assert forbidden.json()["error"] == {
        "message": "weights outside --weights-root",
        "type": "permission_error",
        "param": "path",
        "code": 403,
    }
    assert teapot.status_code == 418 and teapot.json()["error"]["type"] == "teapot_error"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert bug.status_code == 500 and bug.json()["error"]["type"] == "internal_error"


def test_validation_error_names_the_first_field():
    with pytest.raises(ValidationError) as info:
        PassThroughChatRequest.model_validate({"messages": [{"content": "no role"}]})
    error = validation_error(info.value)
    assert isinstance(error, InvalidRequest) and error.status == 400
    assert error.param == "messages.0.role" and "messages.0.role" in error.message


def test_strict_models_refuse_what_pass_through_models_keep():
    wire = {"messages": [{"role": "narrator", "content": "hi"}], "frobnicate": 3}
    kept = PassThroughChatRequest.model_validate(wire)
    assert kept.message_dicts() == [{"role": "narrator", "content": "hi"}]
    with pytest.raises(ValidationError):
        StrictChatRequest.model_validate(wire)  # no such role for a chat template


def test_strict_models_raise_openai_errors_naming_the_field():
    with pytest.raises(InvalidRequest) as info:
        StrictChatRequest.model_validate({"messages": [{"role": "user", "content": "\ud800"}]})
    assert info.value.param == "messages.0.content"


def test_passthrough_forwards_set_and_extra_fields_only():
    body = PassThroughCompletionRequest.model_validate(
        {"prompt": "hi", "model": "m", "stream": True, "max_tokens": 5, "top_k": 3, "echo": None}
    )
    assert passthrough(body) == {"prompt": "hi", "n": 1, "max_tokens": 5, "top_k": 3}


def test_model_list_is_openais_shape():
    assert model_list(["a"], 7, "me", root="/m") == {
        "object": "list",
        "data": [{"id": "a", "object": "model", "created": 7, "owned_by": "me", "root": "/m"}],
    }


def test_completion_body_is_openais_envelope_with_the_prefix_of_its_object():
    chat = completion_body("chat.completion", "m", [{"index": 0}], usage=usage_body(3, 2))
    assert chat["id"].startswith("chatcmpl-") and isinstance(chat["created"], int)
    assert list(chat) == ["id", "object", "created", "model", "choices", "usage"]
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    text = completion_body("text_completion", "m", [])
    assert (
        text["id"].startswith("cmpl-")
        and text["id"] != completion_body("text_completion", "m", [])["id"]
    )


def test_completion_body_keeps_a_given_id_and_time_even_when_empty():
    chunk = completion_body("chat.completion.chunk", "m", [], id="", created=0, usage=None)
    assert chunk == {
        "id": "",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": None,
    }


def test_one_error_type_per_status_whoever_raises_it():
    """A 404 was "NotFoundError" from serve-model and "not_found_error" from the proxy and
    the refusal middleware; the type of each status comes from one table."""
    assert ModelNotFound("gone").type == openai_error_type(404) == "not_found_error"
    assert ModelNotFound("gone").body()["error"]["type"] == "not_found_error"
    assert Forbidden("no").type == openai_error_type(403) == "permission_error"


def test_client_gone_is_a_499_that_needs_no_message():
    gone = ClientGone()
    assert gone.status == 499 and gone.message == "client closed the request"
