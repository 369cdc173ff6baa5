"""The OpenAI-compatible endpoints, driven by the official ``openai`` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.support import direct_logprobs, post

PROMPT = "Alice has 3 apples. Bob gives her 4 more. How many apples does Alice have now?"


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.v1, api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def test_models_lists_every_served_name_with_version(served, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "alias"]
    body = httpx.get(f"{served.v1}/models", timeout=10).json()
    assert body["data"][0]["version"] == 0
    assert body["data"][0]["max_model_len"] > 0


def test_chat_completion_returns_n_choices_and_exact_usage(client, tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": PROMPT},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=messages, n=3, max_tokens=7, extra_body={"ignore_eos": True}
    )
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(r.choices) == 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in r.choices)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 21
    assert r.usage.total_tokens == len(prompt_ids) + 21


def test_alias_name_and_model_directory_are_accepted(served, client):
    r = client.completions.create(model="alias", prompt="hi", max_tokens=2)
    assert r.model == "alias"
    spelled = served.model_dir.rstrip("/") + "/./"
    assert client.completions.create(model=spelled, prompt="hi", max_tokens=2).model == spelled


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":", 1)[1]) for t in tokens]


@pytest.mark.smoke
def test_completion_logprobs_match_direct_forward_pass(client, local_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    r = client.completions.create(
        model="tiny",
        prompt=prompt_ids,
        max_tokens=12,
        n=2,
        logprobs=3,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    for choice in r.choices:
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == 12
        assert all(len(t) == 3 for t in lp.top_logprobs)
        ids = _ids(lp.tokens)
        assert tokenizer.decode(ids) == choice.text
        want = direct_logprobs(local_model, prompt_ids, ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs, want, strict=True)) < 1e-4


def test_chat_logprobs_match_direct_forward_pass(client, local_model, tokenizer):
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        seed=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = _ids([c.token for c in content])
    want = direct_logprobs(local_model, prompt_ids, ids)
    assert max(abs(c.logprob - w) for c, w in zip(content, want, strict=True)) < 1e-4
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True)
        assert tops[0] >= c.logprob - 1e-6


def test_same_seed_gives_same_sample_and_different_seeds_differ(client):
    def text(seed: int) -> str:
        return (
            client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=16,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert text(5) == text(5)
    assert len({text(5), text(6), text(7)}) > 1


def test_greedy_and_top_k_1_follow_the_argmax(served, client, local_model, tokenizer):
    import torch

    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = local_model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
        )[0, len(prompt_ids) :].tolist()
    greedy = post(
        f"{served.url}/generate",
        {
            "prompt": {"prompt_token_ids": prompt_ids},
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert greedy["token_ids"][0] == expected
    topk = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=8, extra_body={"top_k": 1, "ignore_eos": True}
    )
    assert topk.choices[0].text == tokenizer.decode(expected)


def test_stop_string_truncates_text_and_finishes_with_stop(client, tokenizer):
    # A seeded sample is reproducible, so the run with a stop string follows the same path.
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, seed=1)
    base = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip() and base.find(stop) > 0
    r = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.find(stop)]
    kept = client.completions.create(
        **kw, stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == base[: base.find(stop) + len(stop)]


def test_stop_token_id_ends_the_completion_inclusive(served, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    body = {
        "prompt": {"prompt_token_ids": prompt_ids},
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = post(f"{served.url}/generate", body).json()["token_ids"][0]
    cut = post(f"{served.url}/generate", {**body, "stop_token_ids": [full[3]]}).json()
    first = full.index(full[3])
    assert cut["token_ids"][0] == full[: first + 1]
    assert cut["finish_reasons"] == ["stop"]


def test_multiple_prompts_are_ordered_prompt_major(client):
    r = client.completions.create(
        model="tiny",
        prompt=["one", "two", "three"],
        n=2,
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.completion_tokens == 18


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("Hello world")


def test_chat_template_with_tools_is_applied(client, tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate arithmetic.",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=2)
    want = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert r.usage.prompt_tokens == len(want)


def test_continue_final_message_extends_the_assistant_turn(client, tokenizer):
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "The answer is"},
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    want = tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert r.usage.prompt_tokens == len(want)
    assert tokenizer.decode(want).endswith("The answer is")
