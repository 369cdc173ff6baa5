"""Two behaviours third-party trainer clients rely on, against a real ``run-api``: boolean masks
are taken as 0/1 (the original's lax models did), and every 422 ``detail`` entry carries the
``input`` it refused, as FastAPI writes it (bounded: a huge input is described, not echoed)."""

from __future__ import annotations

import pytest

from atroposlib.api.errors import MAX_ECHOED_INPUT, echoed_input
from tests.api.conftest import Api

TOKENS = [[11, 12, 13], [14, 15, 16]]


def test_boolean_masks_are_stored_as_zero_one(fresh: Api):
    fresh.start_trainer(batch_size=4)
    posted = {"tokens": TOKENS, "masks": [[False, True, True], [0, True, 1]], "scores": [1.0, 0.0]}
    assert fresh.client.post("/scored_data", json=posted).status_code == 200
    r = fresh.client.post("/scored_data_list", json=[posted])
    assert r.status_code == 200, r.text
    batch = fresh.client.get("/batch").json()["batch"]
    assert len(batch) == 2
    for group in batch:
        assert group["masks"] == [[0, 1, 1], [0, 1, 1]]
        assert all(type(m) is int for row in group["masks"] for m in row)


def test_boolean_token_ids_stay_422_with_their_input(fresh: Api):
    posted = {"tokens": [[11, True]], "masks": [[1, 1]], "scores": [1.0]}
    r = fresh.client.post("/scored_data", json=posted)
    assert r.status_code == 422, r.text
    entry = next(d for d in r.json()["detail"] if d["loc"] == ["body", "tokens", 0, 1])
    assert entry["input"] is True


@pytest.mark.parametrize(
    "body, loc, value",
    [
        (
            {"tokens": [[1, 2]], "masks": [[1, 2]], "scores": ["high"]},
            ["body", "scores", 0],
            "high",
        ),
        ({"tokens": [[1, 2.5]], "masks": [[1, 2]], "scores": [1]}, ["body", "tokens", 0, 1], 2.5),
        ({"tokens": [[1, 2]], "masks": [[1, 2]]}, ["body", "scores"], None),
    ],
)
def test_422_entries_carry_the_refused_input(fresh: Api, body: dict, loc: list, value: object):
    for path, payload, where in (
        ("/scored_data", body, loc),
        ("/scored_data_list", [body], [loc[0], 0, *loc[1:]]),
    ):
        r = fresh.client.post(path, json=payload)
        assert r.status_code == 422, r.text
        entry = next(d for d in r.json()["detail"] if d["loc"] == where)
        # A missing field's input is the object it is missing from, as in FastAPI.
        assert entry["input"] == (body if value is None else value)


def test_register_422_carries_input(fresh: Api):
    r = fresh.client.post(
        "/register-env",
        json={"max_token_length": "long", "desired_name": "e", "weight": 1.0, "group_size": 4},
    )
    assert r.status_code == 422, r.text
    entry = next(d for d in r.json()["detail"] if d["loc"][-1] == "max_token_length")
    assert entry["input"] == "long"


def test_a_large_input_is_described_not_echoed(fresh: Api):
    row = list(range(5000))
    body = {"tokens": [row], "masks": [row], "scores": [1.0], "env_id": "x"}
    r = fresh.client.post("/scored_data", json={k: v for k, v in body.items() if k != "scores"})
    assert r.status_code == 422
    entry = next(d for d in r.json()["detail"] if d["loc"] == ["body", "scores"])
    assert isinstance(entry["input"], str) and "not echoed" in entry["input"]
    assert len(r.content) < 4 * MAX_ECHOED_INPUT


def test_echoed_input_bounds_and_non_json_values():
    assert echoed_input([1, 2]) == [1, 2]
    assert echoed_input(float("nan")) == "<float: not echoed>"
    big = echoed_input({"k": "x" * (MAX_ECHOED_INPUT + 1)})
    assert big.startswith("<dict: 1 items, ") and big.endswith("not echoed>")
