"""The stored and answered byte forms of the rollout API."""

from __future__ import annotations

import json

from atroposlib.api import codec
from atroposlib.api.compression import pack
from atroposlib.api.models import ScoredData


def test_the_null_fields_follow_the_models_field_order():
    assert codec._GROUP_FIELDS == tuple(ScoredData.model_fields)


def test_canonical_json_inserts_the_absent_fields_as_nulls_after_the_brace():
    body = b'{"tokens":[[1]],"masks":[[1]],"scores":[1.0]}'
    fill = codec.missing_nulls(frozenset({"tokens", "masks", "scores"}))
    stored = json.loads(codec.canonical_json(body, fill))
    assert set(stored) == set(ScoredData.model_fields)
    assert stored["tokens"] == [[1]] and stored["advantages"] is None
    assert codec.canonical_json(body, b"") is body


def test_missing_nulls_are_shared_per_field_set():
    a = codec.missing_nulls(frozenset({"tokens"}))
    assert codec.missing_nulls(frozenset({"tokens"})) is a


def test_posted_form_strips_only_outer_white_space():
    raw, fill = codec.posted_form(b' \n{"tokens": [[1]]} \t', frozenset({"tokens"}))
    assert raw == b'{"tokens": [[1]]}' and b'"masks":null,' in fill


def test_a_packed_group_reads_back_as_its_json():
    body = b'{"tokens":[[1,2,3]]}'
    fill = b'"masks":null,'
    nbytes = len(body) + len(fill)
    assert codec.stored_json(pack(body), fill, True, nbytes) == codec.canonical_json(body, fill)


def test_ingest_answers_keep_their_bytes():
    assert codec.RECEIVED == b'{"status":"received"}'
    assert codec.buffered_answer(3) == b'{"status": "buffered", "buffer_size": 3}'
    assert json.loads(codec.list_answer([("received", 0), ("buffered", 2), ("buffered", 5)])) == {
        "status": "received",
        "groups_processed": 3,
        "buffered": 2,
        "last_buffer_size": 5,
    }
    assert json.loads(codec.list_answer([("received", 0)])) == {
        "status": "received",
        "groups_processed": 1,
    }


def test_batch_answer_joins_the_stored_groups_and_adds_id_step_and_staleness():
    out = codec.batch_answer([b'{"a":1}', b'{"b":2}'], "tok-3", 9, None)
    assert out == b'{"batch":[{"a":1},{"b":2}],"batch_id":"tok-3","step":9}'
    hist = json.loads(codec.batch_answer([b"{}"], "t-1", 1, {"0": 1, "unknown": 0}))
    assert hist["staleness"] == {"0": 1, "unknown": 0}
    assert json.loads(codec.NO_BATCH) == {"batch": None}
    assert (
        json.loads(codec.NOT_REGISTERED)["message"]
        == "Trainer not registered. Call /register first."
    )
