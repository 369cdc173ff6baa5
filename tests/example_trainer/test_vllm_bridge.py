"""The vLLM-free logic of ``example_trainer.vllm_api_server``: request checks, the original's
answer shape, the single-copy refusal (the server itself is tested in tests/vllm/)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from atroposlib.http.openai_protocol import InvalidRequest
from example_trainer.vllm_integration.bridge import (
    LOGPROB_FLOOR,
    available_adapters,
    generate_answer,
    parse_generate,
    shared_weights_problem,
    shared_weights_requested,
)

FIELDS = {"min_tokens", "logit_bias", "output_kind", "n", "max_tokens"}


def test_token_prompt_and_sampling_keywords():
    call = parse_generate(
        {
            "prompt": {"prompt_token_ids": [5, 6]},
            "logprobs": 0,
            "max_tokens": 3,
            "top_k": -1,
            "stop": ["</a>", 7],
            "stop_token_ids": [9],
            "min_tokens": 2,
        },
        FIELDS,
    )
    assert call.prompt == {"prompt_token_ids": [5, 6]} and call.prompt_text is None
    s = call.sampling
    assert s["max_tokens"] == 3 and s["logprobs"] == 0 and s["min_tokens"] == 2
    assert s["top_k"] == 0  # "all" is 0 in vLLM
    assert s["stop"] == ["</a>"] and s["stop_token_ids"] == [9, 7]
    assert call.want_logprobs and not call.want_prompt_logprobs
    text = parse_generate({"prompt": "Hi", "prompt_logprobs": 2}, FIELDS)
    assert text.prompt == {"prompt": "Hi"} and text.prompt_text == "Hi"
    assert text.sampling["max_tokens"] == 16 and "logprobs" not in text.sampling
    assert text.want_prompt_logprobs and not text.want_logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "n": 10_000}, "n"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": {"prompt_token_ids": ["x"]}}, "prompt"),
        ({"prompt": {"prompt_token_ids": []}}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "a", "output_kind": 1}, "output_kind"),  # the server's, not the client's
    ],
)
def test_bad_values_are_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequest) as err:
        parse_generate(body, FIELDS)
    assert err.value.status == 400 and err.value.param == param


def test_not_an_object_is_a_400():
    with pytest.raises(InvalidRequest):
        parse_generate(["prompt"], FIELDS)


def test_answer_has_the_originals_shape():
    outputs = [
        SimpleNamespace(
            text="ab",
            token_ids=(3, 4),
            logprobs=[{3: SimpleNamespace(logprob=-0.5)}, {4: -1.25, 8: -2.0}],
            finish_reason="length",
        ),
        SimpleNamespace(text="c", token_ids=[5], logprobs=[{5: -math.inf}], finish_reason="stop"),
    ]
    answer = generate_answer("Hi", [1, 2], outputs, want_logprobs=True)
    assert answer == {
        "text": ["ab", "c"],
        "prompt": "Hi",
        "finish_reasons": ["length", "stop"],
        "logprobs": [[[{3: -0.5}], [{4: -1.25, 8: -2.0}]], [[{5: LOGPROB_FLOOR}]]],
        "prompt_token_ids": [1, 2],
        "token_ids": [[3, 4], [5]],
    }
    json.dumps(answer, allow_nan=False)  # -inf floored: always valid JSON
    bare = generate_answer("Hi", [1, 2], outputs, want_logprobs=False)
    assert set(bare) == {"text", "prompt", "finish_reasons"}
    scored = generate_answer("Hi", [1, 2], outputs, False, [None, {2: -0.75}])
    assert scored["prompt_logprobs"] == [None, {2: -0.75}]


def test_shared_weights_mode_and_its_refusal():
    assert not shared_weights_requested({})
    assert shared_weights_requested({"VLLM_ENABLE_SHARED_WEIGHTS": "1"})
    assert shared_weights_requested({"NUM_INFERENCE_NODES": "0"})
    assert not shared_weights_requested({"NUM_INFERENCE_NODES": "-1"})
    assert shared_weights_problem(cuda_available=True) is None
    line = shared_weights_problem(cuda_available=False)
    assert line is not None and "\n" not in line
    assert "CUDA" in line and "http_reload" in line


def test_available_adapters(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    (tmp_path / "b").mkdir()
    assert available_adapters(tmp_path) == ["a"]
    assert available_adapters(tmp_path / "missing") == []
