"""tokenize_for_trainer: masks align with tokens and only the trained turns are unmasked."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atroposlib.utils.tokenize_for_trainer import MASK_ID, chat_token_ids, tokenize_for_trainer

TEXT = st.text(alphabet="abcdefghij klmnop 0123456789.,!?", min_size=1, max_size=40)


def _chat(turns):
    chat = [{"role": "system", "content": "You are helpful."}]
    for user, assistant in turns:
        chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return chat


def _unmasked(out):
    return [t for t in out["masks"] if t != MASK_ID]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3))
def test_default_mode_unmasks_exactly_the_last_turn(chat_tokenizer, turns):
    chat = _chat(turns)
    out = tokenize_for_trainer(chat_tokenizer, chat)
    assert len(out["tokens"]) == len(out["masks"])
    assert all(m == MASK_ID or m == t for t, m in zip(out["tokens"], out["masks"], strict=True))
    prefix = chat_token_ids(chat_tokenizer, chat[:-1], add_generation_prompt=True)
    assert out["tokens"][: len(prefix)] == prefix
    assert out["masks"][: len(prefix)] == [MASK_ID] * len(prefix)
    assert out["masks"][len(prefix) :] == out["tokens"][len(prefix) :]
    assert chat_tokenizer.decode(_unmasked(out)).startswith(turns[-1][1])


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3))
def test_all_assistant_turns_mode_unmasks_every_assistant_turn_and_nothing_else(
    chat_tokenizer, turns
):
    chat = _chat(turns)
    out = tokenize_for_trainer(chat_tokenizer, chat, train_on_all_assistant_turns=True)
    assert len(out["tokens"]) == len(out["masks"])
    decoded = chat_tokenizer.decode(_unmasked(out))
    for _user, assistant in turns:
        assert assistant in decoded
    assert "You are helpful." not in decoded
    n_unmasked_last = len(_unmasked(tokenize_for_trainer(chat_tokenizer, chat)))
    assert len(_unmasked(out)) >= n_unmasked_last


def test_include_messages_returns_the_chat(chat_tokenizer):
    chat = _chat([("hi", "hello")])
    assert tokenize_for_trainer(chat_tokenizer, chat, include_messages=True)["messages"] == chat
    assert "messages" not in tokenize_for_trainer(chat_tokenizer, chat)


class _ListTokenizer:
    """Duck-typed tokenizer whose rendering ends with EOS (id 99) and returns plain lists."""

    eos_token_id = 99

    def apply_chat_template(self, chat, tokenize=True, add_generation_prompt=False, **kwargs):
        ids = []
        for m in chat:
            ids += [1] + [ord(c) for c in m["content"]] + [99]
        if add_generation_prompt:
            ids += [1]
        return ids


def test_length_finish_reason_drops_a_trailing_eos():
    chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    full = tokenize_for_trainer(_ListTokenizer(), chat)
    cut = tokenize_for_trainer(_ListTokenizer(), chat, finish_reason="length")
    assert full["tokens"][-1] == 99
    assert cut["tokens"] == full["tokens"][:-1]
    assert cut["masks"] == full["masks"][:-1]
    assert tokenize_for_trainer(_ListTokenizer(), chat, finish_reason="stop") == full


def test_transformers5_dict_return_is_handled(chat_tokenizer):
    chat = _chat([("hi", "hello")])
    expected = chat_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert tokenize_for_trainer(chat_tokenizer, chat)["tokens"] == list(expected)


@pytest.mark.parametrize(
    "chat, field",
    [
        ([], "empty"),
        ([{"role": "user"}], "content"),
        ([{"content": "x"}], "role"),
        (["not a dict"], "not a dict"),
    ],
)
def test_bad_chat_raises_naming_the_problem(chat_tokenizer, chat, field):
    with pytest.raises(ValueError, match=field):
        tokenize_for_trainer(chat_tokenizer, chat)


def test_default_mode_trains_only_the_last_assistant_turn_even_before_a_tool_result(
    chat_tokenizer,
):
    chat = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "calling the tool"},
        {"role": "tool", "content": "tool output 42"},
    ]
    out = tokenize_for_trainer(chat_tokenizer, chat)
    tokens, masks = out["tokens"], out["masks"]
    assert len(masks) == len(tokens)
    start = len(_ids(chat_tokenizer, chat[:3], True))
    end = len(_ids(chat_tokenizer, chat[:4], False))
    assert masks[:start] == [-100] * start
    assert masks[start:end] == tokens[start:end]
    assert masks[end:] == [-100] * (len(tokens) - end)
    trained = chat_tokenizer.decode([t for t in masks if t != -100])
    assert "calling the tool" in trained and "first answer" not in trained
    assert "tool output" not in trained


def _ids(tokenizer, chat, add_generation_prompt):
    from atroposlib.utils.tokenize_for_trainer import chat_token_ids

    return chat_token_ids(tokenizer, chat, add_generation_prompt=add_generation_prompt)
