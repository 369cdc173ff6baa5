"""Token ids and masks posted as integral floats (numpy/torch float arrays serialise so) are
taken as ints, as the original's lax models took them; anything else stays a 422 naming the
element."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import Api


def _floats(group: dict) -> dict:
    return {
        **group,
        "tokens": [[float(t) for t in row] for row in group["tokens"]],
        "masks": [[float(m) for m in row] for row in group["masks"]],
    }


GROUP = {"tokens": [[11, 12, 13], [14, 15, 16]], "masks": [[-100, 12, 13], [-100, 15, 16]]}


def test_integral_float_ids_and_masks_are_stored_as_ints(fresh: Api):
    fresh.start_trainer(batch_size=4)
    posted = _floats({**GROUP, "scores": [1.0, 0.0]})
    assert b"11.0" in json.dumps(posted).encode()
    r = fresh.client.post("/scored_data", json=posted)
    assert r.status_code == 200, r.text
    r = fresh.client.post("/scored_data_list", json=[posted, {**GROUP, "scores": [0.0, 1.0]}])
    assert r.status_code == 200, r.text
    batch = fresh.client.get("/batch").json()["batch"]
    assert len(batch) == 2
    for group in batch:
        assert group["tokens"] == GROUP["tokens"] and group["masks"] == GROUP["masks"]
        assert all(type(t) is int for row in group["tokens"] for t in row)


@pytest.mark.parametrize(
    "body, loc",
    [
        (b'{"tokens": [[1.0, 1.5]], "masks": [[1, 2]], "scores": [1]}', ["body", "tokens", 0, 1]),
        (b'{"tokens": [[1, 2]], "masks": [[1, NaN]], "scores": [1]}', ["body", "masks", 0, 1]),
        (b'{"tokens": [[1e30, 2]], "masks": [[1, 2]], "scores": [1]}', ["body", "tokens", 0, 0]),
        (b'{"tokens": [[-1.0, 2]], "masks": [[1, 2]], "scores": [1]}', ["body", "tokens", 0, 0]),
    ],
)
def test_other_floats_stay_422_naming_the_element(fresh: Api, body: bytes, loc: list):
    r = fresh.client.post(
        "/scored_data", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert loc in [d["loc"] for d in r.json()["detail"]]
    listed = fresh.client.post(
        "/scored_data_list",
        content=b"[" + body + b"]",
        headers={"Content-Type": "application/json"},
    )
    assert listed.status_code == 422
    assert [loc[0], 0, *loc[1:]] in [d["loc"] for d in listed.json()["detail"]]
