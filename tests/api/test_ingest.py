"""Ingest of scored groups: one typed parse per group, exact bytes kept, same error contract.

The fast decoder (simdjson) must never accept what strict pydantic validation
rejects, must agree with it on every accepted group's shape, and a list's
elements must be stored byte for byte as posted (unknown keys included).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atroposlib.api.decode import (
    fast_shape,
    model_shape,
    split_lenient,
    split_list,
    split_shapes,
)
from atroposlib.api.models import ScoredData
from tests.api.conftest import Api, group, start_api

# ------------------------------------------------------------------ generated bodies
_ints = st.integers(-(2**63), 2**63 - 1) | st.integers(-200, 70_000)
_odd_leaf = st.sampled_from(
    [1.0, 1.5, True, None, "7", [2], [[3]], [], {"a": 1}, 2**64, -(2**70), 1e300]
)
_json_scalar = st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}, "ab\\')


@st.composite
def _rows(draw, leaf, n: int) -> list:
    rows = []
    for _ in range(n):
        row = draw(st.lists(leaf, max_size=5))
        if draw(st.integers(0, 99)) == 57:  # now and then one odd element anywhere
            row.insert(draw(st.integers(0, len(row))), draw(_odd_leaf))
        rows.append(row)
    return rows


_floats = st.floats(allow_nan=False, allow_infinity=False) | _ints


@st.composite
def groups(draw) -> dict:
    """Mostly valid groups, with the perturbations that must send a group to pydantic."""
    n = draw(st.sampled_from([0, 1, 2, 3, 4, 4, 4, 4]))
    body: dict = {
        "tokens": draw(_rows(_ints, n)),
        "masks": draw(_rows(_ints, draw(st.sampled_from([n, n, n, max(n - 1, 0)])))),
        "scores": draw(st.lists(_floats, min_size=n, max_size=n)),
    }
    for name in ("advantages", "ref_logprobs", "inference_logprobs"):
        choice = draw(st.integers(0, 3))
        if choice == 1:
            body[name] = None
        elif choice >= 2:
            body[name] = draw(_rows(_floats, n))
    if draw(st.booleans()):
        body["env_id"] = draw(st.sampled_from([None, 0, 3, 2**40, True, 1.0, "0"]))
    for name in draw(
        st.sets(st.sampled_from(["messages", "images", "overrides", "x-trace"]), max_size=1)
    ):
        body[name] = draw(
            st.sampled_from(
                [
                    None,
                    None,
                    [[{"role": "u", "content": "}, {"}]],
                    [[{"role": "u"}]],
                    ["i"],
                    "a[b",
                    7,
                ]
            )
        )
    if draw(st.booleans()):  # not a ScoredData field: kept as posted, read for --max-staleness
        body["policy_version"] = draw(
            st.lists(st.integers(0, 9), max_size=4) | st.sampled_from([[1, [2]], [1.5], "v[", None])
        )
    if draw(st.integers(0, 19)) == 13:
        body["scores" if draw(st.booleans()) else "tokens"] = draw(_json_scalar)
    return body


def _encode(body: dict, style: int) -> bytes:
    if style == 0:
        return json.dumps(body).encode()
    if style == 1:
        return json.dumps(body, separators=(",", ":")).encode()
    return (" \n" + json.dumps(body, indent=1) + "\t").encode()


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(groups(), st.integers(0, 2))
def test_fast_decoder_accepts_only_what_pydantic_accepts_with_the_same_shape(body, style):
    raw = _encode(body, style)
    shape = fast_shape(raw)
    try:
        model = ScoredData.model_validate_json(raw)
    except ValidationError:
        assert shape is None, raw[:300]
        return
    if shape is not None:
        assert dataclasses.replace(shape, version=None) == model_shape(model)
        versions = body.get("policy_version")
        flat = isinstance(versions, list) and all(type(v) is int for v in versions)
        assert shape.version == (min(versions) if flat and versions else None)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tokens": [[1, [2], 3]], "masks": [[1, 2, 3]], "scores": [1.0]}',
        b'{"tokens": [[1, 2, 3]], "masks": [[[1], 2, 3]], "scores": [1.0]}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": [[1.0]]}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": [1.0], "advantages": [[[0.5]]]}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": [1.0], "tokens": [[1.5]]}',
        b'{"tokens": [[true]], "masks": [[1]], "scores": [1.0]}',
        b'{"tokens": [[1.0]], "masks": [[1]], "scores": [1.0]}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": [1.0], "env_id": true}',
    ],
)
def test_shapes_the_fast_decoder_cannot_see_through_are_rejected_by_the_full_check(raw):
    """Flattened nesting, duplicate keys and wrong leaf types never slip through."""
    assert fast_shape(raw) is None
    with pytest.raises(ValidationError):
        ScoredData.model_validate_json(raw)


def test_fast_decoder_handles_the_common_shapes_itself():
    """What environments send takes the fast path (else the speed-up would be fictional)."""
    common = group(4, seq_len=5, env_id=0, inference_logprobs=[[1.0, -0.5, -0.1, 0, -2]] * 4)
    common["advantages"] = None
    common["messages"] = None
    common["trace_id"] = "run-1"
    for raw in (json.dumps(common).encode(), json.dumps(common, separators=(",", ":")).encode()):
        shape = fast_shape(raw)
        assert shape is not None and shape.size == 4 and shape.env_id == 0
        assert shape.rows["inference_logprobs"] == (5, 5, 5, 5)


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[], \\"ab'),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_json_value, max_size=5), st.sampled_from([None, (",", ":"), (" ,\n ", " : ")]))
def test_list_split_returns_each_elements_exact_bytes(elements, separators):
    body = json.dumps(elements, separators=separators).encode()
    pieces = split_list(b" " + body + b"\n")
    assert pieces is not None and [json.loads(p) for p in pieces] == elements
    assert all(p in body for p in pieces)  # cut from the body, not re-serialised
    assert split_lenient(body) == pieces


@settings(max_examples=200, deadline=None)
@given(st.lists(_json_value, max_size=5), st.sampled_from([None, (",", ":"), (" ,\n ", " : ")]))
def test_one_parse_list_cut_is_exact_or_declines(elements, separators):
    """The whole-list parse cuts exactly what msgspec's split cuts, or leaves it to msgspec."""
    body = json.dumps(elements, separators=separators).encode()
    pairs = split_shapes(b" " + body + b"\n")
    if pairs is None:
        return
    assert [raw for raw, _ in pairs] == split_list(body)


def test_one_parse_list_cut_takes_groups_and_declines_nested_objects_and_braces_in_strings():
    groups_ = [group(2, base=1), {**group(3, base=2), "trace_id": "a[b"}, group(1, base=3)]
    body = b" [ " + b" ,\n".join(json.dumps(g).encode() for g in groups_) + b"]"
    pairs = split_shapes(body)
    assert pairs is not None
    assert [raw for raw, _ in pairs] == [json.dumps(g).encode() for g in groups_]
    # the '[' inside trace_id makes its bracket count disagree: that element goes to pydantic
    assert [shape is None for _, shape in pairs] == [False, True, False]
    assert [shape.size for _, shape in pairs if shape is not None] == [2, 1]
    for tricky in ({**group(2), "meta": {"k": 1}}, {**group(2), "trace_id": "}{"}):
        body = json.dumps([group(2), tricky]).encode()
        assert split_shapes(body) is None
        assert split_list(body) == [json.dumps(group(2)).encode(), json.dumps(tricky).encode()]
    assert split_shapes(b'[{"tokens": [[1]]}, 5]') is None
    assert split_shapes(b'{"tokens": [[1]]}') is None


@pytest.mark.parametrize(
    ("token", "fast"), [(2**63 - 1, True), (2**63, False), (2**64 - 1, False), (-1, False)]
)
def test_token_ids_beyond_int64_or_negative_leave_the_fast_path(token, fast):
    raw = json.dumps({"tokens": [[1, token]], "masks": [[1, 1]], "scores": [1.0]}).encode()
    assert (fast_shape(raw) is not None) == fast
    if not fast:
        with pytest.raises(ValidationError):
            ScoredData.model_validate_json(raw)


def test_list_split_declines_what_strict_json_rejects_and_the_lenient_split_reads_it():
    body = b'[{"scores": [NaN]} , {"scores": [-Infinity], "k": "}, {"}]'
    assert split_list(body) is None
    assert split_lenient(body) == [b'{"scores": [NaN]}', b'{"scores": [-Infinity], "k": "}, {"}']


# ------------------------------------------------------------------ against run-api
def _posted_text(g: dict) -> bytes:
    """An element written with unusual but valid number spellings and spacing."""
    return json.dumps(g).replace('"scores": [1.0', '"scores": [1.50e0').encode()


def test_list_elements_are_stored_byte_for_byte_with_unknown_keys(fresh: Api):
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=4)
    tricky = [[{"role": "user", "content": 'a"}, {"b', "meta": {"x": [1, {"y": "}, {"}]}}]] * 4
    first = group(4, env_id=env, base=1, messages=tricky, trace={"id": "}, {", "n": [[]]})
    second = group(4, env_id=env, base=2, note="plain")
    elements = [_posted_text(first), _posted_text(second)]
    body = b"[\n  " + b" ,\n  ".join(elements) + b"\n]"
    r = fresh.client.post(
        "/scored_data_list", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.json() == {"status": "received", "groups_processed": 2}
    raw_batch = fresh.client.get("/batch").content
    for element in elements:  # the posted text survives, minus nothing: only nulls were added
        assert element[1:] in raw_batch
    batch = json.loads(raw_batch)["batch"]
    assert batch[0]["trace"] == {"id": "}, {", "n": [[]]} and batch[0]["messages"] == tricky
    assert batch[1]["note"] == "plain" and batch[1]["advantages"] is None
    assert batch[0]["scores"][0] == 1.5


def test_nan_scores_are_accepted_in_single_and_list_posts_like_the_original(fresh: Api):
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=4)
    single = json.dumps(group(4, env_id=env, score=float("nan"))).encode()
    listed = json.dumps([group(4, env_id=env, base=2, score=float("-inf"))]).encode()
    headers = {"Content-Type": "application/json"}
    assert fresh.client.post("/scored_data", content=single, headers=headers).status_code == 200
    r = fresh.client.post("/scored_data_list", content=listed, headers=headers)
    assert r.status_code == 200, r.text
    batch = json.loads(fresh.client.get("/batch").content)["batch"]
    assert math.isnan(batch[0]["scores"][0]) and batch[1]["scores"][0] == float("-inf")


def test_nested_single_element_arrays_in_rows_are_422(fresh: Api):
    r = fresh.client.post(
        "/scored_data",
        content=b'{"tokens": [[1, [2], 3]], "masks": [[1, 2, 3]], "scores": [1.0]}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "tokens", 0, 1]
    assert fresh.client.get("/status").json()["queue_size"] == 0


def test_list_type_errors_name_every_bad_element_like_pydantic(fresh: Api):
    bad = [group(4), {**group(4), "tokens": [[1.5, 2, 3]] * 4}, {**group(4), "scores": "x"}]
    r = fresh.client.post("/scored_data_list", json=bad)
    assert r.status_code == 422
    locs = [tuple(d["loc"]) for d in r.json()["detail"]]
    assert ("body", 1, "tokens", 0, 0) in locs and ("body", 2, "scores") in locs
    r = fresh.client.post("/scored_data_list", json={"tokens": [[1]]})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "list_type"
    assert fresh.client.get("/status").json()["queue_size"] == 0


# ---------------- lenient per-token fields against run-api (docs/design.md, "Per-token fields")
_OPTIONAL_MISMATCHES = [
    ({"inference_logprobs": [[1.0, -0.5, -0.5]] * 3 + [[1.0]]}, ("body", "inference_logprobs", 3)),
    ({"advantages": [[0.0, 0.0, 0.0]] * 5}, ("body", "advantages")),
    ({"ref_logprobs": [[0.0, 0.0]] + [[0.0, 0.0, 0.0]] * 3}, ("body", "ref_logprobs", 0)),
]
_REQUIRED_MISMATCHES = [
    ({"masks": [[-100, 1, 2]] * 3 + [[1]]}, ("body", "masks", 3)),
    ({"masks": [[-100, 1, 2]] * 5}, ("body", "masks")),
    ({"scores": [1.0] * 3}, ("body", "scores")),
]


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_optional_field_length_mismatches_are_accepted_warned_once_and_counted(tmp_path):
    ctx, url = start_api(tmp_path)
    port = url.rsplit(":", 1)[1]
    with ctx:
        api = Api(url)
        api.start_trainer(batch_size=28)
        env = api.register_env(group_size=4)
        posted = []
        for i, (change, _) in enumerate(_OPTIONAL_MISMATCHES * 2):
            g = {**group(4, env_id=env, base=i + 1), **change}
            r = api.client.post("/scored_data", json=g)
            assert r.json() == {"status": "received"}, r.text
            posted.append(g)
        listed = [{**group(4, env_id=env, base=9), **_OPTIONAL_MISMATCHES[0][0]}]
        assert api.client.post("/scored_data_list", json=listed).status_code == 200
        for (
            change,
            loc,
        ) in _REQUIRED_MISMATCHES:  # counts and mask lengths must still agree for these
            r = api.client.post("/scored_data", json={**group(4, env_id=env), **change})
            assert r.status_code == 422 and [d["loc"] for d in r.json()["detail"]] == [list(loc)]
        metrics = api.client.get("/metrics").text
        field = 'atropos_inconsistent_groups_total{field="%s"}'
        assert _metric(metrics, field % "inference_logprobs") == 3
        assert _metric(metrics, field % "advantages") == 2
        assert _metric(metrics, field % "ref_logprobs") == 2
        assert api.client.get("/status").json()["queue_size"] == 7
        batch = json.loads(api.client.get("/batch").content)["batch"]  # all 7 groups, as posted
        assert [g["tokens"] for g in batch[:6]] == [g["tokens"] for g in posted]
        assert batch[0]["inference_logprobs"] == posted[0]["inference_logprobs"]
        assert batch[1]["advantages"] == posted[1]["advantages"]
        api.client.close()
    log = (tmp_path / f"api-{port}.log").read_text()
    for name in ("inference_logprobs", "advantages", "ref_logprobs"):
        assert log.count(f"env {env} sent {name} whose lengths differ") == 1, log


def test_strict_groups_rejects_optional_field_length_mismatches_with_422(tmp_path):
    ctx, url = start_api(tmp_path, "--strict-groups")
    with ctx:
        api = Api(url)
        for change, loc in _OPTIONAL_MISMATCHES + _REQUIRED_MISMATCHES:
            r = api.client.post("/scored_data", json={**group(4), **change})
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert [tuple(d["loc"]) for d in detail] == [loc] and loc[1] in detail[0]["msg"]
            r = api.client.post("/scored_data_list", json=[group(4), {**group(4), **change}])
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", 1, *loc[1:]]
        assert api.client.get("/status").json()["queue_size"] == 0
        metrics = api.client.get("/metrics").text
        assert _metric(metrics, 'atropos_inconsistent_groups_total{field="advantages"}') == 0
        api.client.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.builds(lambda b: b'{"tokens": [[' + b, st.binary(max_size=60)))
def test_the_decoders_never_raise_on_arbitrary_bytes(raw):
    """A crash here would be a 500; anything unreadable must end as None (then pydantic's 422)."""
    shape = fast_shape(raw)
    assert shape is None or shape.size >= 1
    pieces = split_list(raw)
    assert pieces is None or isinstance(pieces, list)
