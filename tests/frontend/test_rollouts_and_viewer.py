"""Pure pieces of the viewers: indexing/filtering rollouts files, token spans, group HTML, images."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest

from atroposlib.frontend.multimodal import decode_image, extract_text_prompt, group_image
from atroposlib.frontend.rollouts import (
    RolloutFileError,
    RolloutIndex,
    check_group,
    iter_groups,
    score_in_range,
    token_spans,
)
from atroposlib.frontend.viewer import render_group_html


def test_token_spans_mark_trained_tokens_and_hide_placeholder_logprobs() -> None:
    spans = token_spans([10, 11, 12], [-100, 11, 12], [1.0, -0.25, -3.0], lambda t: f"<{t}>")
    assert [(s.trained, s.logprob) for s in spans] == [(False, None), (True, -0.25), (True, -3.0)]
    assert spans[0].text == "<10>"
    # missing or short masks/logprobs: unknown, not an error
    assert [s.trained for s in token_spans([1, 2], [5], None, str)] == [True, False]
    assert all(s.logprob is None for s in token_spans([1, 2], [1, 2], None, str))


@pytest.mark.parametrize(
    "scores, low, high, mode, expected",
    [
        ([1.0, -1.0], 0.5, None, "any", True),
        ([1.0, -1.0], 0.5, None, "all", False),
        ([1.0, -1.0], -0.1, 0.1, "mean", True),
        ([0.2, 0.3], None, 0.25, "any", True),
        ([0.2, 0.3], None, None, "all", True),
        ([], 0.0, None, "any", False),
    ],
)
def test_score_in_range(scores, low, high, mode, expected) -> None:
    assert score_in_range(scores, low, high, mode) is expected


def test_score_in_range_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown score filter mode"):
        score_in_range([1.0], None, None, "median")


@pytest.mark.parametrize(
    "group, message",
    [
        ([1, 2], "expected a JSON object"),
        ({"tokens": [[1]]}, "'scores' is missing"),
        ({"scores": [1.0, "x"], "tokens": [[1]]}, "scores[1] is not a number"),
        ({"scores": [1.0]}, "needs 'tokens' or 'messages'"),
        ({"scores": [1.0], "tokens": "abc"}, "'tokens' must be a list"),
    ],
)
def test_check_group_names_the_problem(group, message) -> None:
    with pytest.raises(RolloutFileError, match=re.escape(message)):
        check_group(group, "f.jsonl:1")


def test_iter_groups_reports_line_numbers(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text('{"scores": [1], "messages": ["a"]}\n\n{"scores": [1], "messages": ["b"]\n')
    it = iter_groups(p)
    assert next(it)[0] == 1
    with pytest.raises(RolloutFileError, match=r"r.jsonl:3: not valid JSON"):
        next(it)


def test_index_filters_by_env_score_and_text_and_reloads_groups(tmp_path: Path) -> None:
    a = tmp_path / "alpha.jsonl"
    a.write_text(
        "\n".join(
            json.dumps(g)
            for g in [
                {"scores": [1.0, 0.0], "messages": ["Paris is nice", "no"]},
                {"scores": [-1.0, -1.0], "messages": ["wrong", "also wrong"], "env_id": 3},
            ]
        )
        + "\n"
    )
    b = tmp_path / "beta.jsonl"
    b.write_text(
        json.dumps({"scores": [0.5], "messages": [[{"role": "user", "content": "PARIS?"}]]}) + "\n"
    )
    index = RolloutIndex.build([a, b])
    assert len(index) == 3
    assert index.envs() == ["alpha", "beta", "env_id=3"]
    assert index.filter(env="alpha") == [0]
    assert index.filter(low=0.4) == [0, 2]
    assert index.filter(high=-0.5, mode="all") == [1]
    assert index.filter(query="paris") == [0, 2]
    assert index.load(2)["messages"][0][0]["content"] == "PARIS?"


def test_index_refuses_empty_and_malformed_files(tmp_path: Path) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(RolloutFileError, match="the file is empty"):
        RolloutIndex.build([empty])
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"scores": [1], "messages": ["x"]}\n\xff\xfe\n')
    with pytest.raises(RolloutFileError, match="b.jsonl:2"):
        RolloutIndex.build([bad])


def test_group_html_escapes_text_and_shows_scores_and_token_stats() -> None:
    group = {
        "scores": [1.0, -0.5],
        "tokens": [[1, 2, 3], [1, 2]],
        "masks": [[-100, 2, 3], [-100, 2]],
        "inference_logprobs": [[1.0, -1.0, -3.0], [1.0, -0.5]],
        "messages": ["<script>x()</script>", [{"role": "assistant", "content": "ok"}]],
    }
    out = render_group_html(group, lambda t: "&" if t == 3 else f"t{t}", title="env · line 1")
    assert "<script>" not in out and "&lt;script&gt;x()&lt;/script&gt;" in out
    assert "Rollout 0 · score 1 · 2/3 tokens trained · mean logprob -2" in out
    assert "Rollout 1 · score -0.5 · 1/2 tokens trained" in out
    assert 'class="rollout reward-negative"' in out
    assert ">&amp;</span>" in out
    assert "assistant: ok" in out


def _png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (255, 0, 0)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_multimodal_image_from_images_field_or_text_and_text_prompt() -> None:
    b64 = _png_b64()
    assert decode_image(b64).size == (3, 2)
    assert decode_image(f"data:image/png;base64,{b64}").size == (3, 2)
    assert decode_image("not an image") is None
    assert group_image({"images": [b64]}).size == (3, 2)
    assert group_image({}, f"look: data:image/png;base64,{b64} done").size == (3, 2)
    assert group_image({}, "no image here") is None
    assert (
        extract_text_prompt('[{"type": "text", "text": "How many \\"apples\\"?"}]')
        == 'How many "apples"?'
    )
    assert extract_text_prompt("<img> [Image] What colour?") == "What colour?"
    assert render_group_html({"scores": [1.0], "images": [b64]}, None).count("<img") == 1
    assert "<img" not in render_group_html({"scores": [1.0], "images": ['"><script>']}, None)


def test_live_group_fields_split_prefix_and_pad_boxes(tokenizer) -> None:
    from atroposlib.frontend.viewer import live_group_fields

    p = tokenizer.encode("Q: hi A: ", add_special_tokens=False)
    group = {
        "tokens": [
            p + tokenizer.encode(c, add_special_tokens=False) for c in ("yes", "no", "maybe")
        ],
        "scores": [1.0, -1.0, 0.0],
    }
    prefix, outs, scores = live_group_fields(group, tokenizer, 2)
    assert prefix == "Q: hi A: " and outs == ["yes", "no"] and scores == ["1.0", "-1.0"]
    _, outs, scores = live_group_fields(group, tokenizer, 4)
    assert outs[-1] == "" and scores == ["1.0", "-1.0", "0.0", ""]


def test_live_outputs_multimodal_adds_image_and_text_prompt(tokenizer) -> None:
    from atroposlib.frontend.viewer import live_outputs

    b64 = _png_b64()
    prompt = '[{"type": "text", "text": "Count the squares"}] '
    p = tokenizer.encode(prompt, add_special_tokens=False)
    group = {
        "tokens": [p + tokenizer.encode(c, add_special_tokens=False) for c in ("3", "4")],
        "scores": [1.0, -1.0],
        "images": [f"data:image/png;base64,{b64}"],
        "env_id": 2,
    }
    image, text, prefix, out0, out1, s0, s1, status = live_outputs(
        [group, group], tokenizer, 2, multimodal=True
    )
    assert image.size == (3, 2) and text == "Count the squares"
    assert (prefix, out0, out1, s0, s1) == (prompt, "3", "4", "1.0", "-1.0")
    assert status == "Batch of 2 groups; showing the first (2 rollouts, env_id=2)."
    assert (
        live_outputs(None, tokenizer, 2, poll_timeout=5)[-1]
        == "No batch arrived within 5 s; press again to keep waiting."
    )
    assert live_outputs(None, tokenizer, 1, multimodal=True)[:2] == [None, ""]


def test_display_tokenizer_decodes_like_transformers(tokenizer, tokenizer_dir) -> None:
    from atroposlib.frontend.dataset_gen import load_display_tokenizer

    light = load_display_tokenizer(str(tokenizer_dir))
    assert type(light).__name__ == "_DisplayTokenizer"
    ids = tokenizer.encode("Héllo, wörld! <|im_end|> 123\n\tend", add_special_tokens=False)
    assert light.decode(ids) == tokenizer.decode(ids)
    assert [light.decode([i]) for i in ids[:5]] == [tokenizer.decode([i]) for i in ids[:5]]


def test_loads_line_accepts_what_python_json_writes() -> None:
    from atroposlib.frontend.rollouts import loads_line

    assert loads_line(b'{"scores": [1.5], "tokens": [[1]]}') == {"scores": [1.5], "tokens": [[1]]}
    nan_line = json.dumps({"scores": [float("nan"), float("inf")], "big": 2**70})
    parsed = loads_line(nan_line)
    assert parsed["scores"][0] != parsed["scores"][0] and parsed["scores"][1] == float("inf")
    assert parsed["big"] == 2**70
    with pytest.raises(json.JSONDecodeError):
        loads_line("{nope")


def test_group_html_shows_shared_turns_once_and_folds_shared_prompt_tokens() -> None:
    from atroposlib.frontend.viewer import shared_masked_prefix, shared_turns

    prompt = [
        {"role": "system", "content": "SYSTEM-PROMPT"},
        {"role": "user", "content": "QUESTION"},
    ]
    group = {
        "scores": [1.0, 0.0],
        "messages": [
            prompt + [{"role": "assistant", "content": "yes"}],
            prompt + [{"role": "assistant", "content": "no"}],
        ],
        "tokens": [[7, 8, 9, 1], [7, 8, 9, 2, 3]],
        "masks": [[-100, -100, -100, 1], [-100, -100, -100, 2, 3]],
    }
    assert shared_turns(group["messages"]) == 2
    assert shared_masked_prefix(group["tokens"], group["masks"]) == 3
    out = render_group_html(group, None)
    assert out.count("SYSTEM-PROMPT") == 1 and out.count("QUESTION") == 1
    assert "Shared by all rollouts" in out
    assert "assistant: yes" in out and "assistant: no" in out
    assert out.count("[7]") == 1 and "[3 prompt tokens as in rollout 0]" in out
    assert "Rollout 1 · score 0 · 2/5 tokens trained" in out  # stats still count every token
    # identical conversations keep their last turn per rollout; trained tokens are never folded
    assert shared_turns([prompt, prompt]) == 1
    assert shared_masked_prefix([[1, 2], [1, 2]], [[1, 2], [1, 2]]) == 0


def test_viewer_shows_turns_of_a_decoded_template_not_its_markup() -> None:
    """``messages`` that BaseEnv synthesised from tokens (one user message holding the
    decoded ChatML) are shown as the turns' text: ``user: 8+7=`` / ``assistant: 15``."""
    import html as html_lib

    from atroposlib.frontend.rollouts import as_turns, default_group_text
    from atroposlib.tiny_model import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    chats = [
        [{"role": "user", "content": "8+7="}, {"role": "assistant", "content": reply}]
        for reply in ("15", "14")
    ]
    tokens = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in chats]
    tokens[1] = list(tokens[1]) + [tok.pad_token_id]  # padding after the end token
    synthesised = [[{"role": "user", "content": tok.decode(t)}] for t in tokens]
    assert "<|im_start|>user" in synthesised[0][0]["content"]  # what BaseEnv stores
    assert as_turns(synthesised[0]) == chats[0]
    assert as_turns(synthesised[1]) == chats[1]
    group = {"tokens": tokens, "masks": tokens, "scores": [1.0, 0.0], "messages": synthesised}
    text = html_lib.unescape(re.sub(r"<[^>]+>", " ", render_group_html(group, None)))
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    assert text.count("user: 8+7=") == 1  # shared turn shown once
    assert "assistant: 15" in text and "assistant: 14" in text
    assert "user: 8+7=" in default_group_text(group)
    # Real messages and plain strings are left alone.
    assert as_turns(chats[0]) is chats[0]
    plain = [{"role": "user", "content": "no template here"}]
    assert as_turns(plain) is plain


def test_llama3_rendering_is_taken_apart_too() -> None:
    from atroposlib.frontend.rollouts import rendered_chat_turns

    text = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    )
    assert rendered_chat_turns(text) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert rendered_chat_turns("just text") is None
