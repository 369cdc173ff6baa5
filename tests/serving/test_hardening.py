"""Hostile and careless clients against the real server (issue items on atropos-serve-model):
bounded sampling parameters, client chat templates, tiny temperatures, huge prompts, the key on
every route, confined weight loading, browser guards, and vLLM-style integer stops."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.support import AUTH, ORIGIN, post

GEN = {"prompt": {"prompt_token_ids": [5, 6, 7]}, "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ----------------------------------------------------------- sampling parameters are bounded

OUT_OF_RANGE = [
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("seed", 2**64),
    ("seed", -(2**64)),
    ("n", 2**63),
    ("max_tokens", 2**63),
    ("stop", ["x" * 257]),
    ("stop", [f"s{i}" for i in range(17)]),
    ("stop_token_ids", [2**63]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", list(range(257))),
    ("logprobs", 2**40),
    ("prompt_logprobs", 21),
]


@pytest.mark.parametrize(
    "name,value", OUT_OF_RANGE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OUT_OF_RANGE)]
)
def test_out_of_range_sampling_parameter_is_400_naming_it(served, name, value):
    err = _error(post(f"{served.url}/generate", {**GEN, name: value}))
    assert err["param"].split(".")[0] == name, err
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_float_parameter_is_400(served, name, literal):
    body = json.dumps(GEN)[:-1] + f', "{name}": {literal}}}'
    r = httpx.post(
        f"{served.url}/generate",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert _error(r)["param"] == name


def test_extreme_but_valid_seeds_are_accepted(served):
    for seed in (2**64 - 1, -(2**63)):
        r = post(f"{served.url}/generate", {**GEN, "seed": seed})
        assert r.status_code == 200, r.text


async def test_bad_request_never_reaches_the_batch_of_good_ones(served):
    """A top_k of 2**63 used to fail the whole decoding step: every request in it got a 500."""
    good = {
        "prompt": {"prompt_token_ids": [5, 6, 7, 8]},
        "max_tokens": 24,
        "ignore_eos": True,
        "top_k": 5,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        runs = [
            asyncio.create_task(client.post(f"{served.url}/generate", json={**good, "seed": i}))
            for i in range(4)
        ]
        for _ in range(200):
            if (await client.get(f"{served.url}/health")).json()["running"]:
                break
            await asyncio.sleep(0.01)
        bad = await client.post(f"{served.url}/generate", json={**good, "top_k": 2**63})
        answers = await asyncio.gather(*runs)
    assert _error(bad)["param"] == "top_k"
    assert [r.status_code for r in answers] == [200] * 4
    assert all(len(r.json()["token_ids"][0]) == 24 for r in answers)


# ------------------------------------------------------------------ tiny temperatures


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-30, 1e-8])
def test_tiny_temperature_gives_finite_logprobs_and_greedy_tokens(served, temperature):
    base = {**GEN, "max_tokens": 6, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    greedy = post(f"{served.url}/generate", {**base, "temperature": 0}).json()
    r = post(f"{served.url}/generate", {**base, "temperature": temperature})
    assert r.status_code == 200, r.text
    body = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-JSON number {c}"))
    assert body["token_ids"] == greedy["token_ids"]
    values = [v for pos in body["logprobs"][0] for d in pos for v in d.values()]
    assert values and all(math.isfinite(v) and v <= 0 for v in values)


def test_tiny_temperature_on_chat_stream_is_valid_json(served):
    body = {**CHAT, "max_tokens": 4, "temperature": 1e-45, "logprobs": True, "top_logprobs": 2}
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event, parse_constant=lambda c: pytest.fail(f"non-JSON number {c}"))
        assert "error" not in chunk, chunk


# ------------------------------------------------- heavy prompts stay off the event loop


class _HealthProbe:
    """Polls /health from a thread and counts the answers while work is under way (a server
    whose event loop is blocked answers none until it is free again)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.get(f"{self.url}/health").raise_for_status()
                self.latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    def __enter__(self) -> _HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_huge_prompts_do_not_block_health_and_are_400(served):
    """An 8 MB prompt is refused without tokenising it; a 1 MB one (just under the character
    bound, so it is tokenised) is tokenised in the thread pool while /health keeps answering."""
    for size in (8_000_000, 1_000_000):
        text = ("hello world, this is a prompt. " * (size // 31 + 1))[:size]
        with _HealthProbe(served.url) as probe:
            while not probe.latencies:  # the probe is running (bounded by its 60 s timeout)
                time.sleep(0.01)
            before = len(probe.latencies)
            r = post(f"{served.url}/v1/completions", {"prompt": text, "max_tokens": 1}, timeout=120)
            during = len(probe.latencies) - before
        err = _error(r)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
        if size == 1_000_000:  # tokenised: /health kept answering meanwhile
            assert during >= 3, during


def test_huge_chat_message_is_400_context_length(served):
    body = {"messages": [{"role": "user", "content": "word " * 1_600_000}], "max_tokens": 1}
    err = _error(post(f"{served.url}/v1/chat/completions", body, timeout=120))
    assert err["code"] == "context_length_exceeded"


# ------------------------------------------------------------------ client chat templates

LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
SIMPLE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"chat_template": SIMPLE}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": SIMPLE}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
    ],
)
def test_client_templates_are_off_by_default(served, extra, param):
    r = post(f"{served.url}/v1/chat/completions", {**CHAT, **extra})
    err = _error(r)
    assert err["param"] == param
    if param.endswith("chat_template"):
        assert "--allow-client-chat-template" in err["message"]


def test_template_variables_are_still_accepted(served):
    r = post(
        f"{served.url}/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.status_code == 200, r.text


def test_allowed_client_template_renders_exactly(keyed, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = post(
        f"{keyed}/v1/chat/completions",
        {**CHAT, "messages": messages, "chat_template": SIMPLE},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    want = tokenizer.encode("<system>be brief<user>hi<assistant>", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize(
    "template,needle",
    [
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{{ 'ab' * 5000000 }}", "limit"),
        ("{% for i in range(30) %}{{ 'x' * 99999 }}{% endfor %}", "exceeds"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "",
        ),
    ],
    ids=["div0", "repeat", "output", "dunder", "syntax", "raise", "doubling"],
)
def test_bad_client_template_is_400(keyed, template, needle):
    r = post(f"{keyed}/v1/chat/completions", {**CHAT, "chat_template": template}, headers=AUTH)
    err = _error(r)
    assert err["param"] == "chat_template" and needle in err["message"], err


def test_looping_client_template_is_stopped_and_health_stays_responsive(keyed):
    with _HealthProbe(keyed) as probe:
        r = post(f"{keyed}/v1/chat/completions", {**CHAT, "chat_template": LOOP}, headers=AUTH)
    err = _error(r)
    assert "did not finish rendering within 1s" in err["message"]
    assert len(probe.latencies) >= 5, probe.latencies  # /health answered while it rendered
    again = post(f"{keyed}/v1/chat/completions", {**CHAT, "chat_template": SIMPLE}, headers=AUTH)
    assert again.status_code == 200, again.text


# ------------------------------------------------------------- the key and weight roots


@pytest.mark.parametrize("route", ["/docs", "/openapi.json", "/redoc", "/health_generate"])
def test_docs_and_schema_need_the_key(keyed, route):
    assert _error(httpx.get(f"{keyed}{route}", timeout=10), 401)["type"] == "authentication_error"
    assert httpx.get(f"{keyed}{route}", headers=AUTH, timeout=30).status_code == 200


def test_health_is_open_with_a_key(keyed):
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200


def test_weights_outside_the_roots_are_403_without_revealing_existence(keyed, tmp_path_factory):
    outside = Path(os.path.realpath("/"))
    here = tmp_path_factory.mktemp("roots")
    escape = here / "escape"
    escape.symlink_to(outside / "etc")
    relative = os.path.relpath("/etc", os.getcwd())
    answers = {}
    for label, path in {
        "exists": "/etc",
        "missing": "/no/such/dir",
        "dotdot": str(here / ".." / ".." / ".." / ".." / ".." / "etc"),
        "relative": relative,
        "symlink": str(escape),
    }.items():
        r = post(f"{keyed}/update_weights", {"path": path}, headers=AUTH)
        answers[label] = _error(r, 403)
    assert all(a == answers["exists"] for a in answers.values()), answers
    assert answers["exists"]["param"] == "path"
    assert "/etc" not in answers["exists"]["message"]


def test_missing_weights_inside_a_root_are_400(keyed, tmp_path_factory):
    inside = tmp_path_factory.mktemp("roots") / "not-yet"
    err = _error(post(f"{keyed}/update_weights", {"path": str(inside)}, headers=AUTH))
    assert err["param"] == "path"


# ------------------------------------------------------------------------- browser guard


def test_non_json_bodies_are_415(served):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = httpx.post(
            f"{served.url}/generate",
            content=json.dumps(GEN),
            headers={"content-type": ctype},
            timeout=10,
        )
        assert _error(r, 415)["message"]


def test_foreign_origin_and_host_are_403(served):
    for headers in (
        {"origin": "http://evil.example"},
        {"host": "evil.example"},
        {"origin": "null"},
    ):
        r = httpx.post(f"{served.url}/generate", json=GEN, headers=headers, timeout=10)
        assert _error(r, 403)["type"] == "permission_error", headers
        g = httpx.get(f"{served.url}/v1/models", headers=headers, timeout=10)
        assert g.status_code == 403
    same = httpx.post(
        f"{served.url}/generate", json=GEN, headers={"origin": served.url}, timeout=30
    )
    assert same.status_code == 200
    assert httpx.get(f"{served.url}/health", headers={"host": "evil.example"}).status_code == 200


def test_cors_origin_is_allowed_and_its_preflight_needs_no_key(keyed):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    ok = httpx.options(f"{keyed}/generate", headers={"origin": ORIGIN, **preflight}, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    foreign = {"origin": "http://evil.example", **preflight}
    assert httpx.options(f"{keyed}/generate", headers=foreign, timeout=10).status_code == 403
    r = httpx.post(f"{keyed}/generate", json=GEN, headers={"origin": ORIGIN, **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    no_key = httpx.post(f"{keyed}/generate", json=GEN, headers={"origin": ORIGIN}, timeout=10)
    assert no_key.status_code == 401


# ------------------------------------------------------------ vLLM-style integer stops


def test_generate_accepts_token_ids_in_stop(served, tokenizer):
    body = {
        "prompt": {"prompt_token_ids": tokenizer.encode("Grace has 12 pencils and")},
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = post(f"{served.url}/generate", body).json()["token_ids"][0]
    target = full[3]
    cut_at = full.index(target) + 1
    for stop in ([target], target, ["no-such-stop-string", target]):
        r = post(f"{served.url}/generate", {**body, "stop": stop})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"][0] == full[:cut_at], stop
        assert r.json()["finish_reasons"] == ["stop"]
    both = post(f"{served.url}/generate", {**body, "stop": [target], "stop_token_ids": [full[1]]})
    assert both.json()["token_ids"][0] == full[: full.index(full[1]) + 1]
    text = post(f"{served.url}/generate", {**body, "stop": [True]})
    assert _error(text)["param"].startswith("stop")


def test_openai_endpoints_keep_string_stops(served):
    r = post(f"{served.url}/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [13]})
    assert _error(r)["param"].startswith("stop")
