"""Bad input gets a 4xx in the OpenAI error format naming the parameter: never a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.serving.support import post

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"prompt": "hi", "max_tokens": 2}
GEN = {"prompt": {"prompt_token_ids": [5, 6]}, "max_tokens": 2}

CASES = [
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 100000}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 5}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "top_k": -3}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "min_p": 2}, "min_p"),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages.0",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "continue_final_message": True, "add_generation_prompt": False},
        "messages",
    ),
    ("/v1/completions", {**COMP, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMP, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [[]]}, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [-1]}, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {**COMP, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMP, "suffix": "x"}, "suffix"),
    ("/v1/completions", {**COMP, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMP, "max_tokens": 10**7}, "max_tokens"),
    ("/generate", {"prompt": {"prompt_token_ids": ["a"]}}, "prompt"),
    ("/generate", {"prompt": {"ids": [1]}}, "prompt"),
    ("/generate", {**GEN, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/generate", {**GEN, "seed": "abc"}, "seed"),
    ("/generate", {**GEN, "stream": True}, "stream"),
    ("/v1/completions", {**COMP, "stream": True, "max_tokens": 10**7}, "max_tokens"),
    ("/update_weights", {}, "path"),
]


@pytest.mark.parametrize(
    "route,body,param", CASES, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(CASES)]
)
def test_bad_parameter_is_400_naming_it(served, route, body, param):
    r = post(f"{served.url}{route}", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"]
    assert err["param"] is not None and err["param"].startswith(param), err


def test_too_long_prompt_is_400_context_length(served):
    r = post(
        f"{served.url}/generate", {"prompt": {"prompt_token_ids": [5] * 40000}, "max_tokens": 1}
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404_in_openai_format(served):
    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMP)):
        r = post(f"{served.url}{route}", {**body, "model": "gpt-17"})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found"
        assert "gpt-17" in err["message"]


@pytest.mark.parametrize(
    "content,ctype,status",
    [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b"prompt=hi", "application/x-www-form-urlencoded", 415),
    ],
)
def test_malformed_body_is_4xx(served, content, ctype, status):
    r = httpx.post(
        f"{served.url}/v1/completions", content=content, headers={"content-type": ctype}, timeout=10
    )
    assert r.status_code == status, r.text
    assert "error" in r.json()


def test_missing_checkpoint_inside_the_weights_root_is_400(served):
    missing = str(Path(served.model_dir).parent / "no-such-checkpoint")
    r = post(f"{served.url}/update_weights", {"path": missing})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "path"


def test_unknown_route_is_404_json(served):
    r = httpx.get(f"{served.url}/v1/engines", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404


def test_server_still_serves_after_bad_requests(served):
    r = post(f"{served.url}/v1/completions", COMP)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_echo_of_out_of_vocabulary_ids_is_400_not_500(served):
    r = post(f"{served.url}/v1/completions", {"prompt": [-5, 3], "echo": True, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
